"""Every preset runs through the real CLI on the tiny model (--smoke), and the paradigms reduce
to pure GRPO when their supervision is empty or weighted 0."""

import copy
import json
from pathlib import Path

import pytest
import torch

from keel.config import Config
from runs import train_cli

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_with_smoke(tmp_path, preset):
    out = train_cli(tmp_path, "run", f"configs/{preset}", "--smoke")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if x.get("phase") == "rl") >= 1
    cfg = (out / "config.yaml").read_text()
    signals_on = [k for k in ("ops", "hint", "ets", "reflection") if f"{k}:\n    enabled: true" in cfg]
    keys = set().union(*lines)
    expected = {"ops": "signal/ops_members", "hint": "signal/hinted_groups", "ets": "signal/ets_buffer", "reflection": "signal/reflections"}
    for k in signals_on:  # metrics show what each signal did at each step
        assert expected[k] in keys, (preset, k)


def _weights(run: Path):
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))


def _rl_lines(run: Path):
    drop = ("time/", "mem/", "rollout/tokens_per_s")
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(drop)} for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_interleaved_with_empty_schedule_equals_pure_grpo(tmp_path):
    # OPS makes the tiny model's groups non-uniform, so real updates happen in both runs
    base = ["configs/smoke.yaml", "--set", "signals.ops.enabled=true", "--set", "signals.ops.mode=replace", "--set", "signals.ops.members=1"]
    pure = train_cli(tmp_path, "pure", *base)
    # the whole interleaved machinery on (gold SFT pool, schedule), its only phase after step 1000
    inter = train_cli(tmp_path, "inter", *base, "--set", "signals.sft=true", "--set", "signals.paradigm=interleaved", "--set", "signals.at_steps=[1000]")
    assert _rl_lines(pure) == _rl_lines(inter)
    a, b = _weights(pure), _weights(inter)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_synchronous_weight_zero_equals_pure_grpo_update(tiny):
    """Inside the update: a weight-0 supervision loss leaves the step unchanged (AdamW, same seed)."""
    from fakes import EchoEnv, make_tasks
    from keel.losses import group_advantages
    from keel.rollout import SamplingParams, rollout
    from keel.sft import decompose, gold_trajectory
    from keel.train import grpo_update

    model, tok = tiny
    env = EchoEnv()
    tasks = [t for t in make_tasks(2) for _ in range(2)]
    trajs = rollout(model, tok, env, tasks, SamplingParams(max_turns=1, max_new_tokens=12), generator=torch.Generator().manual_seed(0), groups=[0, 0, 1, 1])
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    gold_task = make_tasks(1)[0]
    gold_task.gold_turns = [[{"name": "lookup", "arguments": {"x": "a"}}]]
    examples = decompose(gold_trajectory(tok, env, gold_task))
    results = []
    for extra in ([], [("sft", 0.0, examples)]):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        grpo_update(m, copy.deepcopy(model), opt, trajs, adv, Config().grpo, tok.pad_token_id, 1.0, extra_losses=extra)
        results.append({k: v.clone() for k, v in m.state_dict().items()})
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    # and a positive weight does change the step
    m = copy.deepcopy(model)
    grpo_update(m, copy.deepcopy(model), torch.optim.AdamW(m.parameters(), lr=1e-3), trajs, adv, Config().grpo, tok.pad_token_id, 1.0, extra_losses=[("sft", 1.0, examples)])
    assert any(not torch.equal(results[0][k], v) for k, v in m.state_dict().items())
