"""Helpers for tests that compare whole runs through the real CLI: the deterministic part of
metrics.jsonl, a step-by-step comparison, killing a run at a metrics line, and a free loopback
port for launched servers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.metrics import NONDETERMINISTIC_PREFIXES

REPO = Path(__file__).resolve().parent.parent
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_cli(tmp_path: Path, name: str, *args: str) -> Path:
    """`keel train ARGS --out tmp_path/name` through the real CLI from the repository root, one
    thread, no progress bars; asserts it succeeded and returns the run directory."""
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "keel.cli", "train", *args, "--out", str(out), "--set", "run.progress=false"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def deterministic_lines(run: Path) -> list[dict]:
    """metrics.jsonl of `run` without wall-time, memory and throughput keys."""
    out = []
    for line in (Path(run) / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        out.append({k: v for k, v in d.items() if not k.startswith(NONDETERMINISTIC_PREFIXES) and not k.startswith("time/")})
    return out


def assert_same_lines(got: list[dict], expected: list[dict], rel: float = 1e-5, abs: float = 1e-7) -> None:
    """Same number of lines, same keys per line, floats within rel/abs, everything else equal."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys(), a["step"]
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], rel=rel, abs=abs), (a["step"], k)
            else:
                assert a[k] == b[k], (a["step"], k)


def kill_at_metrics_line(proc: subprocess.Popen, metrics: Path, cut: int, timeout: float = 300) -> None:
    """SIGKILL `proc` once `metrics` (a metrics.jsonl it writes) has `cut` lines; wait for it."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= cut:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
