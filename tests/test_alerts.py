"""A detector's rollback action in a real (smoke) run: the policy returns to the peak checkpoint,
the configured change is applied, and both alerts.jsonl and metrics.jsonl show it."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_rollback_action_shows_in_alerts_and_metrics(tmp_path):
    out = tmp_path / "run"
    sets = [
        "signals.ops.enabled=true", "signals.ops.mode=replace", "signals.ops.members=1",  # non-uniform groups: real updates, entropy logged
        "grpo.steps=3", "eval.every=1",  # a peak checkpoint exists from the first RL step
        # an entropy detector tuned to fire at once: "collapse" below 10× the first value
        "detectors.entropy.early_steps=1", "detectors.entropy.smooth=1", "detectors.entropy.fraction=10.0",
        "detectors.entropy.action=rollback", "detectors.entropy.on_rollback={grpo.kl_coef: x5}",
        "grpo.kl_coef=0.001", "run.progress=false",
    ]
    args = [x for s in sets for x in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "keel.cli", "train", "configs/smoke.yaml", "--out", str(out), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    alerts = [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()]
    rollbacks = [a for a in alerts if a["action"] == "rollback"]
    assert rollbacks and rollbacks[0]["kind"] == "entropy"
    first = rollbacks[0]
    assert first["rolled_back_to"] is not None and first["rolled_back_to"] <= first["step"]
    assert first["config_now"] == {"grpo.kl_coef": 0.005}  # 0.001 × 5
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    marked = [x for x in lines if x.get("alerts/rollback") == 1.0]
    assert marked and marked[0]["step"] == first["step"]
    assert "ALERT entropy" in r.stdout
