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
    # --smoke is a user's pre-flight check: every signal the preset turns on must really act in it
    from keel.config import load_config

    out = train_cli(tmp_path, "run", f"configs/{preset}", "--smoke")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in lines if x.get("phase") == "rl"]
    cfg = load_config(out / "config.yaml")
    if cfg.grpo.steps == 0:  # an SFT-only preset (claim3_fc_sft) keeps its shape: the warm-start ran, no RL step
        assert any(x.get("phase") == "sft" for x in lines) and not rl, preset
        return
    assert len(rl) >= 1
    s = cfg.signals
    most = lambda key: max((x.get(key) or 0.0 for x in lines), default=0.0)  # noqa: E731
    phases = [x for x in lines if "signal/phase_steps" in x]  # interleaved supervision steps
    if s.ops.enabled:
        assert most("signal/ops_members") > 0, (preset, "no gold member joined a group")
    if s.hint.enabled:
        assert most("signal/hinted_groups") > 0, (preset, "no group was hinted")
    kinds = {"sft": s.sft, "ets": s.ets.enabled, "reflection": s.reflection.enabled}
    if kinds["ets"]:
        assert most("signal/ets_buffer") > 0, (preset, "ETS never held a failed prompt")
    if kinds["reflection"]:
        assert most("signal/reflections") > 0, (preset, "no reflection was written")
    for kind in (k for k, on in kinds.items() if on):
        if s.paradigm == "interleaved":
            assert any(kind in str(x["signal/phase_steps"]) for x in phases), (preset, f"no interleaved {kind} phase ran")
        else:
            assert any((x.get(f"loss/{kind}") or 0.0) > 0 for x in rl), (preset, f"no {kind} loss in an RL update")


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


def test_phase_examples_caps_each_interleaved_phase(tmp_path):
    # 3 examples drawn from the gold pool, 2 epochs in batches of 2: 2+1 then 2+1 per phase
    out = train_cli(tmp_path, "run", "configs/kg_interleaved_sft.yaml", "--smoke", "--set", "signals.phase_examples=3",
                    "--set", "signals.epochs=2", "--set", "signals.batch_size=2")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sft = [x for x in lines if x.get("phase") == "sft"]
    assert [x["signal/sft_examples"] for x in sft] == [2.0, 1.0, 2.0, 1.0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_train"] > 3  # the pool is larger than what the phase trained on


def test_phase_examples_must_be_a_count(tmp_path):
    from keel.config import load_config
    from keel.config import ConfigError

    with pytest.raises(ConfigError, match=r"signals.phase_examples must be an integer >= 0 .* got -1"):
        load_config("configs/kg_interleaved_sft.yaml", ["signals.phase_examples=-1"])
