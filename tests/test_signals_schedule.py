"""Schedule as data (synchronous vs interleaved), and the two ways a supervision loss is applied."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from keel.signals.schedule import Schedule, SignalsConfig, SupervisionPhase, run_phase, sample_examples, signals_from_dict, supervision_backward
from keel.sft import decompose, gold_trajectory
from test_signals_ops import KG_ENV, kg_task


def test_paper_a_interleaved_schedule():
    s = Schedule.from_config({"sft": True, "at_steps": [50, 100, 150], "epochs": 2, "lr": 1e-5, "batch_size": 128}, rl_lr=1e-6)
    phases = {step: s.phase_after(step) for step in range(1, 301)}
    assert {k for k, v in phases.items() if v is not None} == {50, 100, 150}
    assert phases[50] == SupervisionPhase(kind="sft", epochs=2, lr=1e-5, sources=("sft",), batch_size=128)
    assert s.rl_lr == 1e-6 and s.sync_weight("sft") == 0.0  # interleaved: nothing inside the RL update


def test_every_n_steps_with_several_kinds():
    s = Schedule.from_config({"every": 25, "at_steps": [10], "ets": {"enabled": True}, "reflection": {"enabled": True}}, 1e-6)
    assert [k for k in range(1, 80) if s.phase_after(k)] == [10, 25, 50, 75]
    assert s.phase_after(25) == SupervisionPhase("ets+reflection", 2, 1e-5, ("ets", "reflection"), 8)


def test_synchronous_weights():
    s = Schedule.from_config({"paradigm": "synchronous", "sft": True, "reflection": {"enabled": True}, "sft_weight": 0.5, "reflection_weight": 0.1}, 1e-6)
    assert (s.sync_weight("sft"), s.sync_weight("reflection"), s.sync_weight("ets")) == (0.5, 0.1, 0.0)
    assert all(s.phase_after(k) is None for k in range(1, 200))
    with pytest.raises(ValueError, match="unknown supervision kind 'ops'"):
        s.sync_weight("ops")
    # no supervision at all: plain GRPO
    none = Schedule.from_config(SignalsConfig(), 1e-6)
    assert none.kinds == () and none.phase_after(50) is None and none.sync_weight("sft") == 0.0


def test_dataclass_and_mapping_agree():
    cfg = SignalsConfig()
    cfg.sft, cfg.at_steps = True, [5]
    cfg.ets.enabled = True
    assert Schedule.from_config(cfg, 1e-6) == Schedule.from_config({"sft": True, "at_steps": [5], "ets": {"enabled": True}}, 1e-6)


@pytest.mark.parametrize(
    "d, message",
    [
        ({"paradigm": "mixed"}, "signals.paradigm must be one of"),
        ({"sft": True, "at_steps": [100, 50]}, "must be increasing"),
        ({"sft": True, "at_steps": [0]}, "RL steps >= 1"),
        ({"sft": True}, "sft is on with paradigm interleaved but no phase is scheduled"),
        ({"paradigm": "synchronous", "at_steps": [5]}, "apply to the interleaved paradigm only"),
        ({"reflection": {"enabled": True, "analyzer": "llm"}, "every": 5}, "needs signals.reflection.base_url"),
        ({"ops": {"mode": "swap"}}, "signals.ops.mode must be replace or add"),
        ({"epochs": 0}, "signals.epochs must be >= 1"),
        ({"sft_weight": -1.0}, r"signals.\*_weight must be >= 0"),
        ({"hint": {"place": "user"}}, r"unknown config key 'signals.hint.place'"),
        ({"epochs": "2"}, r"'signals.epochs' expects an integer, got '2'"),  # keel.config.set_key's words
        ({"sft": 1}, r"'signals.sft' expects true/false"),
    ],
)
def test_bad_settings_are_one_line_errors(d, message):
    with pytest.raises(ValueError, match=message):
        Schedule.from_config(d, 1e-6)


def test_signals_from_dict_coerces_int_to_float():
    assert signals_from_dict({"lr": 1, "hint": {"fail_at": 0}}).lr == 1.0


def _examples(tok):
    return decompose(gold_trajectory(tok, KG_ENV, kg_task()))  # 3 single-step examples


def test_supervision_backward_is_weighted_nll(tiny):
    base, tok = tiny
    examples = _examples(tok)
    model = copy.deepcopy(base)
    model.zero_grad()
    loss_1 = supervision_backward(model, examples, tok.pad_token_id, weight=1.0, micro=2)
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_half = supervision_backward(model, examples, tok.pad_token_id, weight=0.5, micro=8)
    g_half = [p.grad.clone() for p in model.parameters()]
    assert abs(loss_1 - loss_half) < 1e-5 and loss_1 > 5.0  # unweighted NLL per token; random model: about ln(49152) = 10.8
    assert all(torch.allclose(a * 0.5, b, atol=1e-7) for a, b in zip(g1, g_half))
    assert supervision_backward(model, [], tok.pad_token_id) == 0.0


def test_run_phase_equals_train_sft_step(tiny):
    from keel.train import sft_step

    base, tok = tiny
    examples = _examples(tok)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    phase = SupervisionPhase("sft", epochs=1, lr=1e-3, sources=("sft",), batch_size=len(examples))
    # SGD, not AdamW: Adam's first step is ±lr wherever a gradient is ~1e-9 noise, so float-order
    # differences (the batch order differs) would show as lr-sized parameter differences
    lines = run_phase(a, examples, phase, tok.pad_token_id, max_grad_norm=1.0, rng=random.Random(0), optimizer=torch.optim.SGD(a.parameters(), lr=1e-1))
    opt = torch.optim.SGD(b.parameters(), lr=1e-1)
    stats = sft_step(b, opt, examples, tok.pad_token_id, max_grad_norm=1.0)
    assert len(lines) == 1 and abs(lines[0]["loss/sft"] - stats["loss/sft"]) < 1e-5
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), base.parameters()))
    two_epochs = run_phase(copy.deepcopy(base), examples, SupervisionPhase("sft", 2, 1e-3, ("sft",), 2), tok.pad_token_id, 1.0, random.Random(0))
    assert len(two_epochs) == 4 and [line["signal/sft_examples"] for line in two_epochs] == [2.0, 1.0, 2.0, 1.0]  # ceil(3 / 2) = 2 steps per epoch


def test_sample_examples():
    rng = random.Random(0)
    assert sample_examples([1, 2], 5, rng) == [1, 2]
    got = sample_examples(list(range(10)), 3, rng)
    assert len(got) == 3 and len(set(got)) == 3
