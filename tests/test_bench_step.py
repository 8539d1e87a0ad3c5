"""bench/grpo_step_vs_commit.py: the per-token arithmetic and its argument errors (the timed runs
themselves are a benchmark, not a test)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("grpo_step_vs_commit", Path(__file__).resolve().parents[1] / "bench" / "grpo_step_vs_commit.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def step(tokens, members, rollout, update):
    return {"rollout/policy_tokens": tokens, "loss/trained_members": members, "time/rollout_s": rollout, "time/update_s": update}


def test_per_token_leaves_out_the_warm_up_step_and_normalises_by_tokens_and_members():
    # timed: 1,000 + 3,000 tokens in 10 + 20 s, 16 + 8 members updated in 8 + 4 s
    m = bench.per_token([step(9999, 32, 99.0, 99.0), step(1000, 16, 10.0, 8.0), step(3000, 8, 20.0, 4.0)])
    assert m == {"steps": 2, "policy_tokens_per_step": 2000.0, "trained_members_per_step": 12.0, "rollout_s_per_step": 15.0,
                 "update_s_per_step": 6.0, "rollout_s_per_1k_tokens": 7.5, "update_s_per_member": 0.5}
    # one step only: it is all there is
    assert bench.per_token([step(500, 4, 5.0, 2.0)])["rollout_s_per_1k_tokens"] == 10.0


def test_bad_arguments_are_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["grpo_step_vs_commit.py", "--model", str(tmp_path / "nope"), "--before", str(tmp_path)])
    with pytest.raises(SystemExit, match="--model has no config.json"):
        bench.main()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    monkeypatch.setattr(sys, "argv", ["grpo_step_vs_commit.py", "--model", str(tmp_path / "ckpt"), "--before", str(tmp_path)])
    with pytest.raises(SystemExit, match="--before is not a Keel tree"):
        bench.main()
