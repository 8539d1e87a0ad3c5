"""A run directory: created once, never overwritten, every file written atomically.

Layout: config.yaml · metrics.jsonl · alerts.jsonl · samples/step_NNNNNN.jsonl ·
eval/step_NNNNNN.jsonl · checkpoints/{latest,peak}/ · summary.json · report.html.

Atomicity: whole files go through a temp file + fsync + os.replace; JSONL lines are appended
with one write + flush + fsync each, and readers skip a torn last line. A checkpoint is
written into a temp directory and swapped in with renames, so a kill mid-write leaves the
previous checkpoint loadable.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable


class RunDirError(RuntimeError):
    """The run directory cannot be used (exists, unwritable, disk full). One-line message."""


def create_run_dir(path: Path, exist_ok_resume: bool = False) -> Path:
    """Create `path` for a new run; refuse an existing non-empty one (never overwrite results)."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not exist_ok_resume:
        raise RunDirError(f"run directory {path} already exists and is not empty; choose another --out or use --resume {path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"run directory {path} is not writable: {e.strerror or e}") from None
    free = shutil.disk_usage(path).free
    if free < 200 * 1024 * 1024:
        raise RunDirError(f"run directory {path}: only {free // (1024 * 1024)} MB free on its disk, need at least 200 MB")
    return path


def default_run_dir(parent: str | Path, preset_name: str) -> Path:
    """parent/<preset>-<n> with the first n not taken (a new directory every time)."""
    parent = Path(parent)
    n = 1
    while (parent / f"{preset_name}-{n}").exists():
        n += 1
    return parent / f"{preset_name}-{n}"


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _clean(v: Any) -> Any:
    """JSON-safe: NaN/inf become null (json.dumps would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(_clean(obj), indent=2, ensure_ascii=False) + "\n")


def append_jsonl(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(_clean(obj), ensure_ascii=False) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(path: Path, rows: Iterable[Any]) -> None:
    atomic_write_text(path, "".join(json.dumps(_clean(r), ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines; a torn or garbage line (a kill mid-write) is skipped."""
    out = []
    path = Path(path)
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def iter_jsonl_strict(path: Path, what: str = "data file"):
    """(line number, parsed JSON) for each non-blank line of an input file; a missing file or a
    bad line is a one-line error naming the file and line (inputs must be whole, unlike the
    run directory's own logs, which `read_jsonl` reads leniently)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None


def truncate_jsonl_lines(path: Path, n: int) -> None:
    """Keep the first n complete lines (on resume, lines written after the checkpoint are redone)."""
    path = Path(path)
    if not path.exists():
        return
    rows = read_jsonl(path)[:n]
    write_jsonl(path, rows)


def swap_dir(tmp: Path, final: Path) -> None:
    """Replace directory `final` by `tmp` with renames; at every instant one complete copy exists
    (final, or final.old while the swap is in flight; `load` falls back to .old)."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
