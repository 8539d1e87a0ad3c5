"""The whole training loop under `accelerate launch` with 2 CPU processes (gloo) ends with the
same weights and the same metrics, step for step, as one process with the same global batch.

The run covers SFT (an uneven 2/1 split of a 3-example batch), GRPO with off-policy expert
members (so the tiny random model gets non-zero advantages and the weights really move), and
sharded evaluation (3 dev questions: 2 + 1). AdamW's eps is 1e-4 here: with 1e-8 its first
steps are ≈ lr·sign(g) and turn summation-order noise of near-zero gradient entries into weight
differences of order lr (measured: 5.7e-3 after 3 steps at lr 1e-3); with 1e-4 the two runs
agree to ~1e-7 while moving 3e-3 (measured).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.config import Config
from keel.distributed import DistContext
from keel.run import check_distributed_config
from runs import assert_same_lines, deterministic_lines, free_port

REPO = Path(__file__).resolve().parent.parent
ARGS = ["configs/smoke.yaml", "--set", "signals.ops.enabled=true", "--set", "signals.ops.mode=replace", "--set", "signals.ops.members=1",
        "--set", "run.progress=false", "--set", "grpo.lr=1e-3", "--set", "grpo.steps=3",
        "--set", "eval.every=2", "--set", "grpo.adam_eps=1e-4", "--set", "sft.enabled=true", "--set", "sft.steps=2",
        "--set", "sft.batch_size=3", "--set", "sft.lr=1e-3", "--set", "eval.n_dev=3", "--set", "data.n_dev=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.mark.skipif(not ACCELERATE.exists(), reason="accelerate's launcher is not installed next to this Python")
def test_two_processes_under_accelerate_launch_match_one_process(tmp_path):
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "keel.cli", "train", *ARGS, "--out", str(one)], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    launch = [str(ACCELERATE), "launch", "--config_file", "configs/accelerate/ddp_cpu.yaml", "--main_process_port", str(free_port()),
              "-m", "keel.cli", "train", *ARGS, "--out", str(two)]
    r = subprocess.run(launch, cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((two / "summary.json").read_text())["processes"] == 2

    expected, got = deterministic_lines(one), deterministic_lines(two)
    assert [d["phase"] for d in got] == ["eval", "sft", "sft", "eval", "rl", "rl", "rl"]
    assert_same_lines(got, expected, rel=1e-4, abs=1e-6)
    for name in ("step_000000.jsonl", "step_000005.jsonl"):  # dev records gathered in dev order
        assert (two / "eval" / name).read_text() == (one / "eval" / name).read_text()

    w1 = load_file(str(one / "checkpoints" / "latest" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "latest" / "model.safetensors"))
    w0 = load_file(str(one / "checkpoints" / "reference" / "model.safetensors"))  # the policy as RL started
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w1)
    assert moved > 1e-3  # 3 RL steps at lr 1e-3 (measured 3.0e-3)
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert diff < 1e-6, diff  # measured 1.2e-7


def test_what_runs_in_one_process_only_is_refused_by_name():
    cfg = Config()
    cfg.rollout.prompts_per_step = 4
    check_distributed_config(cfg, DistContext(0, 2))  # plain GRPO: fine
    cfg.signals.reflection.enabled = True
    with pytest.raises(ValueError, match="signals.reflection"):
        check_distributed_config(cfg, DistContext(0, 2))
    cfg = Config()
    cfg.rollout.prompts_per_step = 4
    cfg.signals.sft = True
    cfg.signals.paradigm = "synchronous"
    cfg.signals.sft_weight = 0.1
    with pytest.raises(ValueError, match="synchronous"):
        check_distributed_config(cfg, DistContext(0, 2))
    cfg = Config()
    cfg.rollout.prompts_per_step = 3
    with pytest.raises(ValueError, match="prompts_per_step=3 is not a multiple of the 2 processes; use 4"):
        check_distributed_config(cfg, DistContext(1, 2))
