"""A run directory: created once, never overwritten, every file written atomically.

Layout: config.yaml · metrics.jsonl · alerts.jsonl · samples/step_NNNNNN.jsonl ·
eval/step_NNNNNN.jsonl · checkpoints/{latest,peak}/ · summary.json · report.html.

Atomicity: whole files go through a temp file + fsync + os.replace; JSONL lines are appended
with one write + flush + fsync each, and readers skip a torn last line. A checkpoint is
written into a temp directory and swapped in with renames, so a kill mid-write leaves the
previous checkpoint loadable.

Reading one back: `read_run` (the logs and the per-step files, leniently), which the report,
`keel compare` and `keel diagnose` all start from.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from keel.errors import UserError



class RunDirError(UserError, RuntimeError):
    """The run directory cannot be used (exists, in use, unwritable, disk full). One-line message."""


LOCK_FILE = ".keel.lock"  # RUN/.keel.lock: flock-ed by the one process that owns RUN, holds its pid
MIN_FREE_MB = 200  # a run needs room for checkpoints; checked before the directory is made


class RunDirLock:
    """This process's ownership of a run directory: an exclusive `flock` on RUN/.keel.lock,
    held until `release()` (the kernel drops it if the process dies, so a killed run leaves no
    stale lock). It records what this process created, so that `discard()` deletes only that:
    the directory and any parents it made, or, in a directory that existed empty, its files."""

    def __init__(self, path: Path, fd: int, created: list[Path], existed_empty: bool):
        self.path, self.fd, self.created, self.existed_empty = path, fd, created, existed_empty

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None

    def discard(self) -> None:
        """Delete what this process created (a fresh run that failed before logging a step), then
        release the lock. Never touches a directory another process owns: this one holds it."""
        if self.fd is not None:
            if self.existed_empty:
                for child in list(self.path.iterdir()):
                    if child.name != LOCK_FILE:
                        shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() else child.unlink(missing_ok=True)
                (self.path / LOCK_FILE).unlink(missing_ok=True)
            elif self.created:
                shutil.rmtree(self.path, ignore_errors=True)
                for parent in reversed(self.created[:-1]):  # parents made for it, innermost first, if still empty
                    try:
                        parent.rmdir()
                    except OSError:
                        break
        self.release()

    def discard_if_fresh(self) -> None:
        """`discard()` unless the run logged something (a complete metrics line): a run with a
        step done is resumable and is kept; in any case the lock is released."""
        if self.fd is not None and not read_jsonl(self.path / "metrics.jsonl")[0]:
            self.discard()
        self.release()

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def is_empty_dir(path: Path) -> bool:
    """A directory with nothing in it but (perhaps) a lock file: a new run may be made there."""
    return all(p.name == LOCK_FILE for p in Path(path).iterdir())


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_free_space(path: Path) -> None:
    where = _existing_ancestor(path)
    free = shutil.disk_usage(where).free
    if free < MIN_FREE_MB * 1024 * 1024:
        raise RunDirError(f"run directory {path}: only {free // (1024 * 1024)} MB free on its disk ({where}), need at least {MIN_FREE_MB} MB")


def _holder(lock: Path) -> str:
    try:
        pid = lock.read_text().strip()
    except OSError:
        pid = ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _lock(path: Path, created: list[Path], existed_empty: bool, fresh: bool) -> RunDirLock:
    """flock RUN/.keel.lock without waiting; a directory someone else holds is refused untouched.
    For a fresh run the directory must hold nothing but the lock once it is ours (another
    process may have filled it between our look and our lock)."""
    import fcntl

    lock = path / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise RunDirError(f"run directory {path} is not writable: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise _taken(f"run directory {path} is in use by another keel process{_holder(lock)}; wait for it to end, or choose another --out") from None
    try:
        same = os.fstat(fd).st_ino == os.stat(lock).st_ino  # not a lock file its owner deleted meanwhile
    except OSError:
        same = False
    if not same or (fresh and any(p.name != LOCK_FILE for p in path.iterdir())):
        os.close(fd)  # lost a race to another process: it owns (or owned) the directory now
        raise _taken(f"run directory {path} was just taken by another keel process; choose another --out")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as e:
        os.close(fd)
        raise RunDirError(f"run directory {path} is not writable: {e.strerror or e}") from None
    return RunDirLock(path, fd, created, existed_empty)


def claim_run_dir(path: Path) -> RunDirLock:
    """Own a new run directory: refuse anything but a missing or empty directory, check the disk
    before making it, make it exclusively (mkdir fails if another process made it first), then
    lock it. On refusal nothing is created and nothing is changed."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} exists and is not a directory; choose another --out")
    if path.is_dir() and not is_empty_dir(path):
        raise RunDirError(f"run directory {path} already exists and is not empty; choose another --out or use --resume {path}")
    _check_free_space(path)
    created: list[Path] = []
    existed_empty = path.is_dir()
    if not existed_empty:
        missing = []
        p = path.absolute()
        while not p.exists():
            missing.append(p)
            p = p.parent
        try:
            for d in reversed(missing):
                try:
                    os.mkdir(d)
                except FileExistsError:
                    if d == path.absolute():
                        raise _taken(f"run directory {path} was just created by another keel process; choose another --out") from None
                    continue
                created.append(d)
        except OSError as e:
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    pass
            raise RunDirError(f"run directory {path} cannot be created: {e.strerror or e}") from None
    try:
        return _lock(path, created, existed_empty, fresh=True)
    except RunDirError as e:
        if not getattr(e, "taken", False):  # unwritable: undo our mkdirs; a taken directory is another's now
            for d in reversed(created):
                shutil.rmtree(d, ignore_errors=True) if d == path.absolute() else _rmdir_quiet(d)
        raise


def _rmdir_quiet(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def _taken(message: str) -> RunDirError:
    e = RunDirError(message)
    e.taken = True
    return e


def lock_run_dir(path: Path) -> RunDirLock:
    """Own an existing run directory (`--resume`): refused at once if another process holds it."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"run directory {path} not found")
    return _lock(path, [], False, fresh=False)


def create_run_dir(path: Path, exist_ok_resume: bool = False) -> Path:
    """Check and make `path` for a new run, then let it go (for callers that own it otherwise);
    refuses an existing non-empty one (never overwrite results)."""
    if exist_ok_resume and Path(path).is_dir():
        return Path(path)
    claim_run_dir(path).release()
    (Path(path) / LOCK_FILE).unlink(missing_ok=True)
    return Path(path)


def default_run_dir(parent: str | Path, preset_name: str) -> Path:
    """parent/<preset>-<n> with the first n not taken (a new directory every time)."""
    parent = Path(parent)
    n = 1
    while (parent / f"{preset_name}-{n}").exists():
        n += 1
    return parent / f"{preset_name}-{n}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file (0644 under the usual umask 022)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (temp file + fsync + rename), with the mode an ordinary
    new file gets (mkstemp's temp files are 0600: others could not read config.yaml)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        _name_file(e, path)
        raise


def _name_file(e: BaseException, path: Path) -> None:
    """An OSError from write/fsync carries no file name (ENOSPC says only "No space left on
    device"): give it the file being written, for the one-line error. Only one with an errno:
    str() of an OSError with a file name shows errno and strerror, so an OSError("message")
    given a file name would lose its message."""
    if isinstance(e, OSError) and e.filename is None and e.errno is not None:
        e.filename = str(path)


def disk_full(exc: BaseException, path: Path) -> OSError | None:
    """An ENOSPC OSError naming `path` if `exc` (from a writer that does not say so itself:
    safetensors raises SafetensorError, torch.save a RuntimeError) came from a full disk."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return exc
    try:
        full = "No space left on device" in str(exc) or shutil.disk_usage(_existing_ancestor(Path(path))).free < 1024 * 1024
    except OSError:
        full = False
    return OSError(errno.ENOSPC, "No space left on device", str(path)) if full else None


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
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        _name_file(e, path)
        raise


def write_jsonl(path: Path, rows: Iterable[Any]) -> None:
    atomic_write_text(path, "".join(json.dumps(_clean(r), ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSON objects of a run directory's own JSONL log, and one line per line skipped
    ("metrics.jsonl:7: not JSON (JSONDecodeError), skipped"); a missing file is ([], []).

    The run's logs are read leniently: a crash leaves a torn last line, and a resumed run
    appends after it, so a torn line can also sit in the middle. Callers that need every line
    (per-question statistics) check the problems themselves. Lines end at "\\n" only: a record
    may hold U+2028 and its kin raw (json.dumps with ensure_ascii=False writes them so), which
    str.splitlines would cut.
    """
    path = Path(path)
    if not path.is_file():
        return [], []
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    raw_lines = path.read_bytes().split(b"\n")
    last = len(raw_lines)
    while last > 0 and not raw_lines[last - 1].strip():
        last -= 1
    for number, raw in enumerate(raw_lines[:last], start=1):
        if not raw.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            kind = "torn last line" if number == last else "not JSON"
            problems.append(f"{where}: {kind} ({type(exc).__name__}), skipped")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: a JSON {type(obj).__name__}, not an object, skipped")
            continue
        rows.append(obj)
    return rows, problems


STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


def step_files(folder: Path) -> dict[int, Path]:
    """{step: path} for the `step_000010.jsonl` files of a folder, by step (empty if it is missing)."""
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = STEP_FILE.match(p.name)
        if m and p.is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


@dataclass
class RunFiles:
    """What a run directory's logs hold, read leniently (`read_jsonl`: a torn or garbage line is
    skipped and named in `problems`). Readers derive their own views from it: the report's metric
    curves (keel.report), the failure-mode signals (keel.diagnostics.classify)."""

    directory: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl's objects, in file order
    alerts: list[dict[str, Any]] = field(default_factory=list)  # alerts.jsonl's objects, in file order
    samples: dict[int, Path] = field(default_factory=dict)  # samples/step_N.jsonl by step (read on demand: they are large)
    evals: dict[int, Path] = field(default_factory=dict)  # eval/step_N.jsonl by step
    problems: dict[str, list[str]] = field(default_factory=dict)  # "metrics.jsonl" / "alerts.jsonl" -> skipped lines


def read_run(run_dir: str | os.PathLike) -> RunFiles:
    """The logs of a run directory and its per-step files; missing parts stay empty."""
    directory = Path(run_dir)
    run = RunFiles(directory)
    run.metrics, run.problems["metrics.jsonl"] = read_jsonl(directory / "metrics.jsonl")
    run.alerts, run.problems["alerts.jsonl"] = read_jsonl(directory / "alerts.jsonl")
    run.samples = step_files(directory / "samples")
    run.evals = step_files(directory / "eval")
    return run


def parse_jsonl(lines: Iterable[str], path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line of an input file; a line that is not
    JSON is a one-line UserError naming the file and line (inputs must be whole, unlike the run
    directory's own logs, which `read_jsonl` reads leniently). What a record must hold (an
    object, an id) the caller checks, in its own words."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise UserError(f"{path}:{lineno}: not valid JSON (nested too deeply)") from None
        yield lineno, record


def iter_jsonl_strict(path: Path, what: str = "data file") -> Iterator[tuple[int, Any]]:
    """`parse_jsonl` over a UTF-8 file; a missing file or one that is not UTF-8 is a one-line
    error naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, encoding="utf-8") as f:
        lineno = 0
        try:
            for lineno, record in parse_jsonl(f, path):
                yield lineno, record
        except UnicodeDecodeError:
            raise UserError(f"{what} {path}: not UTF-8 text (after line {lineno})") from None


def truncate_jsonl_lines(path: Path, n: int) -> None:
    """Keep the first n complete lines (on resume, lines written after the checkpoint are redone)."""
    path = Path(path)
    if not path.exists():
        return
    rows = read_jsonl(path)[0][:n]
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


# ---------------------------------------------------------------------------------------------
# Checkpoint integrity (resume)
# ---------------------------------------------------------------------------------------------
def checkpoint_problem(ck: Path) -> str | None:
    """What is wrong with checkpoint directory `ck`, or None if every file is whole: trainer_state.json
    parses, model.safetensors' header and size agree (a truncated copy does not), each .pt is a
    complete zip archive (torch.save's format; a truncated one has no central directory). Reads
    headers only, not the weights."""
    import struct
    import zipfile

    state = ck / "trainer_state.json"
    if not state.exists():
        return "no trainer_state.json (an incomplete checkpoint)"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"trainer_state.json is not valid JSON ({type(e).__name__})"
    weights = ck / "model.safetensors"
    if weights.exists():
        try:
            with open(weights, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if weights.stat().st_size < 8 + n + end:
                return f"model.safetensors is truncated ({weights.stat().st_size} bytes, its header needs {8 + n + end})"
        except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as e:
            return f"model.safetensors is unreadable ({type(e).__name__})"
    for pt in sorted(ck.glob("*.pt")):
        if not zipfile.is_zipfile(pt):
            return f"{pt.name} is truncated or not a torch file"
    return None


def usable_checkpoint(latest: Path) -> Path | None:
    """Check checkpoints/latest before a resume loads it. Whole: returned as it is. Corrupt,
    with a whole `latest.old` (a kill between swap_dir's renames leaves one): the corrupt copy is
    kept as `latest.corrupt` and `.old` takes its place. Corrupt with nothing to fall back on: a
    RunDirError that says what to do. Missing (killed before the first checkpoint): None."""
    latest = Path(latest)
    old = latest.with_name(latest.name + ".old")
    if not latest.exists() and not old.exists():
        return None
    problem = checkpoint_problem(latest) if latest.exists() else "missing"
    if problem is None:
        reference = latest.with_name("reference")  # the KL reference an RL-phase resume loads
        bad = checkpoint_problem(reference) if (reference / "model.safetensors").exists() else None
        if bad is not None:
            run = latest.parent.parent
            raise RunDirError(f"checkpoint {reference} is corrupt ({bad}); the RL phase cannot continue without it: delete "
                              f"{latest} and run `keel train --resume {run}` again to restart from step 0")
        return latest
    if old.exists() and checkpoint_problem(old) is None:
        if latest.exists():
            aside = latest.with_name(latest.name + ".corrupt")
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(latest, aside)
            print(f"[keel] warning: {latest} is corrupt ({problem}); resuming from {old.name} (the corrupt copy is kept as {aside.name})", flush=True)
        os.replace(old, latest)
        return latest
    if not latest.exists():
        return None
    run, peak = latest.parent.parent, latest.with_name("peak")
    keep = (f"; to keep its training, start a new run from its peak weights with --set model.name={peak}"
            if checkpoint_problem(peak) is None and (peak / "model.safetensors").exists() else "")
    raise RunDirError(f"checkpoint {latest} is corrupt ({problem}) and there is no intact {old.name} to fall back on; to restart {run} "
                      f"from step 0, delete {latest} and run `keel train --resume {run}` again{keep}")
