"""Never lose work: kill -9 at a random point and resume gives the same metrics, step for step,
as an uninterrupted run; a kill while a checkpoint is being written leaves a loadable one."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runs import assert_same_lines, deterministic_lines, kill_at_metrics_line

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--set", "sft.steps=3", "--set", "grpo.steps=3", "--set", "eval.every=2", "--set", "grpo.skip_zero_advantage=false",
        "--set", "grpo.kl_coef=0.1", "--set", "run.progress=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cmd(*args):
    return [sys.executable, "-m", "keel.cli", "train", *args]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("resume") / "straight"
    r = subprocess.run(_cmd("configs/smoke.yaml", "--out", str(run), *ARGS), cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    expected = deterministic_lines(run)
    assert len(expected) >= 7  # eval, 3 sft, eval, 3 rl
    return expected


def _kill_after(run: Path, cut: int) -> None:
    """Start the smoke run into `run` and SIGKILL it once metrics.jsonl has `cut` lines."""
    proc = subprocess.Popen(_cmd("configs/smoke.yaml", "--out", str(run), *ARGS), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    kill_at_metrics_line(proc, run / "metrics.jsonl", cut, timeout=240)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


@pytest.mark.parametrize("where", ["random step", "before the first checkpoint"])
def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path, straight, where):
    # "before the first checkpoint": killed once the first line (the eval before SFT) is out,
    # while step 1 runs or its checkpoint is being written; resume starts over from step 0
    cut = random.Random(os.getpid()).randint(2, len(straight) - 2) if where == "random step" else 1
    killed = tmp_path / "killed"
    _kill_after(killed, cut)
    r = subprocess.run(_cmd("--resume", str(killed)), cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_lines(deterministic_lines(killed), straight)


def test_resume_of_a_directory_that_is_not_a_run_is_a_one_line_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    r = subprocess.run(_cmd("--resume", str(run)), cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "no config.yaml" in r.stderr.strip().splitlines()[-1]


_WRITER = r"""
import sys, torch
from pathlib import Path
from keel.models import load_model
from keel.checkpoint import save_checkpoint
model, tok = load_model("tiny", seed=int(sys.argv[2]))
print("ready", flush=True)
for i in range(1000):
    save_checkpoint(Path(sys.argv[1]), model, tok, None, {"step": int(sys.argv[2])})
"""


def test_kill_during_checkpoint_write_leaves_a_loadable_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from keel.models import load_model
    from keel.checkpoint import complete_checkpoint, save_checkpoint

    model, tok = load_model("tiny", seed=0)
    path = tmp_path / "checkpoints" / "latest"
    save_checkpoint(path, model, tok, None, {"step": 0})
    reference = {0: model.state_dict(), 1: load_model("tiny", seed=1)[0].state_dict()}
    rng = random.Random(0)
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "1"], cwd=REPO, stdout=subprocess.PIPE, text=True, env=ENV)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))  # the writer loops on save_checkpoint: the kill lands mid-write
        proc.kill()
        proc.wait()
        ck = complete_checkpoint(path)
        assert ck is not None, f"trial {trial}: no loadable checkpoint"
        step = json.loads((ck / "trainer_state.json").read_text())["step"]
        weights = load_file(str(ck / "model.safetensors"))
        for k, v in weights.items():
            assert torch.equal(v, reference[step][k]), (trial, k)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_checkpoints_and_resume_equals_the_uninterrupted_run(tmp_path, straight, sig):
    """SIGTERM (kill, docker stop, a scheduler's pre-emption) does what Ctrl-C does: finish the
    step, checkpoint, write summary.json, exit 128 + the signal (130, 143); the resumed run is
    the uninterrupted one, step for step."""
    run = tmp_path / "interrupted"
    proc = subprocess.Popen(_cmd("configs/smoke.yaml", "--out", str(run), *ARGS), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out[-2000:]
    assert "stopped cleanly" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupted_by"] == signal.Signals(sig).name
    assert summary["eval_final"] is None  # no final evaluation yet (not the pre-SFT one under that name)
    r = subprocess.run(_cmd("--resume", str(run)), cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_lines(deterministic_lines(run), straight)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["interrupted_by"] is None and summary["eval_final"] is not None


def test_a_signal_during_the_post_sft_eval_stops_before_the_first_rl_step(tmp_path, monkeypatch):
    """A signal that lands while the post-SFT evaluation runs stops the run once the RL phase is
    set up and checkpointed, not after a whole RL step (which can take minutes); resume goes on
    from RL step 1."""
    from keel.config import load_config
    import keel.train
    from keel.train import train

    real = keel.train.evaluate

    def evaluate(run, label):
        means = real(run, label)
        if label == "after_sft":  # as the handler does when SIGTERM arrives during this eval
            run.interrupted.flag, run.interrupted.signal_name = True, "SIGTERM"
        return means

    monkeypatch.setattr(keel.train, "evaluate", evaluate)
    overrides = [a for a in ARGS if a != "--set"]
    summary = train(load_config(REPO / "configs/smoke.yaml", overrides), tmp_path / "run")
    phases = [json.loads(line).get("phase") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["interrupted"] is True and summary["interrupted_by"] == "SIGTERM"
    assert phases == ["eval", "sft", "sft", "sft", "eval"]  # no RL line
    assert (tmp_path / "run" / "checkpoints" / "reference").is_dir()
