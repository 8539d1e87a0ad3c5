"""Continuing a run directory: the one path `keel train --resume RUN` and `keel sweep` share.

`finished` says whether a run needs no resume, `resume_run` continues one from
checkpoints/latest, and `exit_status` turns a run's summary into the command's exit status.
Both commands import these from here (the sweep imported them from keel.cli, which imports the
sweep: the package's one import cycle besides the config's).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from keel.config import load_config
from keel.rundir import RunDirError


def exit_status(summary: dict) -> int:
    """0 for a run that ended; 128 + the signal's number for one a signal stopped (130 for
    SIGINT, 143 for SIGTERM), as a shell reports a process the signal killed."""
    name = summary.get("interrupted_by") if summary.get("interrupted") else None
    return 128 + int(getattr(signal, name, signal.SIGINT)) if summary.get("interrupted") else 0


def resume_run(run: Path, overrides: list[str] | None = None, announce: bool = True) -> dict | None:
    """`keel train --resume RUN`: its own config.yaml (plus `overrides`, written back to it), from
    checkpoints/latest. A finished run is left as it is (None; it says so). `keel sweep`
    continues its interrupted runs through this same function."""
    from keel.train import train  # torch: only when a run is resumed

    run = Path(run)
    if not run.is_dir():
        raise RunDirError(f"--resume {run}: no such directory")
    if not (run / "config.yaml").exists():
        raise RunDirError(f"--resume {run}: no config.yaml (not a Keel run directory)")
    cfg = load_config(run / "config.yaml", overrides or [])
    done = finished(run, cfg)
    if done:
        if announce:
            print(f"[keel] {run} is finished ({done}); nothing to resume. To train further: keel train --resume {run} --set grpo.steps=N")
        return None
    return train(cfg, run, resume=True)


def finished(run: Path, cfg) -> str | None:
    """Why `run` needs no resume (its summary.json says it ended, and `cfg` asks no more GRPO
    steps than it did), or None. Resuming it anyway would only rewrite summary.json."""
    try:
        s = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or s.get("phase") != "done" or s.get("interrupted") is not False:
        return None
    done = s.get("grpo_steps_done", 0)
    if cfg.grpo.steps > max(done, load_config(run / "config.yaml").grpo.steps):
        return None  # --set grpo.steps=N asks for more
    if s.get("stopped_by_alert"):
        return f"stopped by an alert at step {s['stopped_by_alert'].get('step')}"
    return f"{done} GRPO steps done, grpo.steps={cfg.grpo.steps}"
