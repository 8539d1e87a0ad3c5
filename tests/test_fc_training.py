"""Function calling in the training loop: gold trajectories pass BFCL's checker, and a smoke
GRPO run on the learnable task goes through the real CLI."""

import json
import subprocess
import sys
from pathlib import Path

from keel.fc.learnable import LearnableEnv, generate_tasks
from keel.rewards import REWARDS
from keel.sft import decompose, gold_trajectory

REPO = Path(__file__).resolve().parent.parent


def test_gold_trajectories_are_valid_for_the_checker(tiny):
    _, tok = tiny
    env = LearnableEnv()
    for task in generate_tasks(6, seed=3):
        gold = gold_trajectory(tok, env, task)
        assert gold.info["checker_valid"] is True, task.id
        assert REWARDS["fc_binary"](gold, task)[0] == 1.0
        # one SFT example per assistant turn: call turns and closing turns
        assert len(decompose(gold)) == len(gold.turn_spans) >= 2


def test_smoke_grpo_on_the_learnable_task_through_the_cli(tmp_path):
    out = tmp_path / "fc"
    r = subprocess.run([sys.executable, "-m", "keel.cli", "train", "configs/fc_smoke.yaml", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in lines if x.get("phase") == "rl"]
    assert len(rl) == 2 and "reward/valid" in rl[0] and "eval/em" in rl[-1]
