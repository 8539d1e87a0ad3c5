"""Detectors fire on histories shaped like the papers' collapses, once, and stay silent on a
healthy noisy plateau; state round-trips exactly."""

from __future__ import annotations

import json
import random

import pytest

from keel.config import CliffConfig, DetectorConfig
from keel.diagnostics.detectors import Detectors


def run(history, detectors=None):
    det = detectors or Detectors()
    alerts = []
    for line in history:
        alerts += det.update(line["step"], line)
    return alerts


def paper_b_cliff(seed=0):
    """Paper B, R-selfV: eval every 50 steps, EM peaks at 0.395 (step 250) and is 0 at step 300;
    tools/question 3.0 → 1.0 in the same window."""
    rng = random.Random(seed)
    evals = {0: (0.20, 2.5), 50: (0.30, 2.8), 100: (0.35, 3.0), 150: (0.37, 3.0), 200: (0.38, 3.0), 250: (0.395, 3.0), 300: (0.0, 1.0)}
    lines = []
    for s in range(301):
        tools = 3.0 + rng.gauss(0, 0.1) if s < 250 else 3.0 - 2.0 * (s - 250) / 50 + rng.gauss(0, 0.05)
        line = {"step": s, "tools/per_question": tools, "reward/mean": 0.5 + rng.gauss(0, 0.02)}
        if s in evals:
            line["eval/em"], line["eval/tools_per_question"] = evals[s]
        lines.append(line)
    return lines


def test_cliff_and_call_volume_fire_once_on_paper_b_shape():
    alerts = run(paper_b_cliff())
    kinds = [(a.kind, a.step) for a in alerts]
    cliff = [a for a in alerts if a.kind == "cliff"]
    assert len(cliff) == 1 and cliff[0].step == 300
    assert cliff[0].evidence == {
        "eval/em": 0.0, "peak": 0.395, "peak_step": 250, "previous": 0.395,
        "tools_per_question_before": 3.0, "tools_per_question_now": 1.0,
    }
    volume = [a for a in alerts if a.kind == "call_volume"]
    # The train series crosses 0.5 × 3.0 ≈ 1.5 calls (5-step median) around step 288; the eval
    # series fires at step 300 (1.0 ≤ 0.5 × 3.0).
    assert {a.evidence["series"] for a in volume} == {"tools/per_question", "eval/tools_per_question"}
    train = next(a for a in volume if a.evidence["series"] == "tools/per_question")
    assert 280 <= train.step <= 295 and train.evidence["ratio"] <= 0.5
    assert all(k in ("cliff", "call_volume") for k, _ in kinds), kinds
    assert all(a.action == "warn" and a.on_rollback == {} for a in alerts)


def test_call_volume_takes_no_reference_from_a_policy_stuck_at_the_turn_limit():
    # The main job's seed 2 (thirtieth session): after SFT every dev episode called until the
    # 4-turn limit and none answered (4.0 calls); RL taught 2 calls and an answer (2.0, EM 0.98).
    # 2.0 ≤ 0.5 × 4.0, but 4.0 was the limit, not a volume the policy chose: no alert.
    stuck = [{"step": 8, "eval/tools_per_question": 4.0, "eval/answered": 0.0},
             {"step": 16, "eval/tools_per_question": 2.0, "eval/answered": 1.0}]
    assert run(stuck) == []
    # The same fall from a policy that answered (paper B's shape: it called, answered, then quit calling).
    answered = [dict(line, **{"eval/answered": 1.0}) for line in stuck]
    alerts = run(answered)
    assert [(a.kind, a.step, a.evidence["reference_step"], a.evidence["ratio"]) for a in alerts] == [("call_volume", 16, 8, 0.5)]
    # A log without eval/answered (older runs, envs without it): every level is a reference, as before.
    assert [(a.kind, a.step) for a in run([{k: v for k, v in line.items() if k != "eval/answered"} for line in stuck])] == [("call_volume", 16)]
    # Training series: the turn-limit share is 1 − rollout/truncated_share, smoothed like the calls
    # (5-step median). Five steps at the limit (4 calls, all truncated), then 2 calls answered:
    # the median level falls from 4.0 to 2.0 at step 7, with no reference taken before it.
    train = [{"step": s, "tools/per_question": 4.0 if s < 5 else 2.0, "rollout/truncated_share": 1.0 if s < 5 else 0.0} for s in range(12)]
    assert run(train) == []
    assert [(a.kind, a.step) for a in run([dict(x, **{"rollout/truncated_share": 0.0}) for x in train])] == [("call_volume", 7)]


def test_cliff_rearms_only_after_recovery_and_rollback_carries_overrides():
    cfg = DetectorConfig(cliff=CliffConfig(action="rollback", on_rollback={"grpo.kl_coef": "x5"}))
    ems = [0.3, 0.4, 0.05, 0.0, 0.0, 0.38, 0.4, 0.1]
    alerts = run([{"step": 50 * i, "eval/em": v} for i, v in enumerate(ems)], Detectors(cfg))
    assert [(a.kind, a.step) for a in alerts] == [("cliff", 100), ("cliff", 350)]
    assert alerts[0].action == "rollback" and alerts[0].on_rollback == {"grpo.kl_coef": "x5"}
    # A slow slide (0.02 per eval) never drops 0.1 within one window: no cliff.
    slide = [{"step": 50 * i, "eval/em": 0.4 - 0.02 * i} for i in range(15)]
    assert run(slide) == []


def test_control_token_kl_spike_fires_once():
    rng = random.Random(1)
    lines = []
    for s in range(140):
        share = 0.12 + rng.gauss(0, 0.01) if s < 100 else 0.7
        tag = 0.01 + rng.gauss(0, 0.001) if s < 100 else 0.25
        lines.append({"step": s, "kl/control_share": share, "kl/tag/<tool_call>": tag, "kl/tag/<answer>": 0.01 + rng.gauss(0, 0.001)})
    alerts = run(lines)
    assert [(a.kind, a.step) for a in alerts] == [("kl_spike", 100)]
    series = alerts[0].evidence["series"]
    assert set(series) == {"kl/control_share", "kl/tag/<tool_call>"}
    assert series["kl/control_share"]["value"] == 0.7 and series["kl/control_share"]["robust_z"] > 6


def test_entropy_format_drift_and_proxy_gaming():
    lines = []
    for s in range(300):
        line = {
            "step": s,
            "tokens/entropy": 1.5 if s < 100 else max(0.1, 1.5 - (s - 100) * 0.02),
            "collapse/format_drift": 0.0 if s < 150 else 0.3,
            "reward/mean": 0.2 + 0.002 * s,  # +0.2 per 100 steps
        }
        if s % 50 == 0:
            line["eval/em"] = 0.10 if s == 0 else 0.30 if s < 150 else 0.25
        lines.append(line)
    alerts = {a.kind: a for a in run(lines)}
    # Entropy: early level 1.5; the 5-step median falls below 0.45 when 1.5 − 0.02·(s − 100 − 2) < 0.45.
    assert alerts["entropy"].step == 155 and alerts["entropy"].evidence["early_level"] == 1.5
    # Drift: 3-step means at 150 = 0.1 (not above), at 151 = 0.2.
    assert alerts["format_drift"].step == 151
    # Proxy gaming: windows of 100 steps. Up to step 100 the window holds the eval at step 0
    # (EM 0.10 → 0.30: learning, silent). At step 101 the window [1, 101] holds evals 50 and 100
    # (0.30 → 0.30: flat) while the reward's fitted rise is 0.002 × 100 = 0.2 ≥ 0.1.
    assert alerts["proxy_gaming"].step == 101 and alerts["proxy_gaming"].evidence == {"reward_rise": 0.2, "em_gain": 0.0, "window": 100}
    assert len(run(lines)) == 3


def test_entropy_of_an_update_that_trained_nothing_is_no_level():
    """An RL step whose groups all had equal rewards trains no member, and step_metrics logs its
    tokens/entropy as 0.0 (no token measured). Ten trained steps at 1.2, then 0.0 at steps that
    trained nothing: no entropy collapse. The same 0.0s as trained steps: the 5-step median (steps 8–12) is 0
    at step 12 (< 0.3 × 1.2), so it fires there. Steps that train nothing are also left out of
    the early level: with the first ten steps untrained, the early level is the next ten's."""
    trained = [{"step": s, "tokens/entropy": 1.2, "loss/trained_members": 8} for s in range(10)]
    untrained = [{"step": s, "tokens/entropy": 0.0, "loss/trained_members": 0} for s in range(10, 30)]
    assert run(trained + untrained) == []
    as_trained = [{**line, "loss/trained_members": 3} for line in untrained]
    assert [(a.kind, a.step) for a in run(trained + as_trained)] == [("entropy", 12)]
    late = [{"step": 10 + s, "tokens/entropy": 0.2 if s >= 10 else 1.0, "loss/trained_members": 4} for s in range(20)]
    alerts = run([{**line, "step": s} for s, line in enumerate(untrained[:10])] + late)
    assert [(a.kind, a.step, a.evidence["early_level"]) for a in alerts] == [("entropy", 22, 1.0)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_silent_on_healthy_noisy_plateau(seed):
    rng = random.Random(seed)
    lines = []
    for s in range(500):
        line = {
            "step": s,
            "reward/mean": 0.5 + rng.gauss(0, 0.05),
            "tools/per_question": 2.5 + rng.gauss(0, 0.3),
            "tokens/entropy": 1.2 + rng.gauss(0, 0.1),
            "kl/control_share": 0.15 + rng.gauss(0, 0.02),
            "kl/tag/<tool_call>": 0.02 + rng.gauss(0, 0.002),
            "kl/tag/</tool_call>": 0.02 + rng.gauss(0, 0.002),
            "collapse/format_drift": abs(rng.gauss(0, 0.01)),
            "phase": "rl",
        }
        if s % 50 == 0:
            line["eval/em"] = 0.35 + rng.gauss(0, 0.02)
            line["eval/tools_per_question"] = 2.5 + rng.gauss(0, 0.2)
        lines.append(line)
    assert run(lines) == []


def test_state_dict_resume_is_exact():
    history = paper_b_cliff(seed=3)
    straight = [a.to_dict() for a in run(history)]
    first = Detectors()
    resumed = [a.to_dict() for a in run(history[:270], first)]
    second = Detectors()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed += [a.to_dict() for a in run(history[270:], second)]
    assert resumed == straight and len(straight) >= 3
    with pytest.raises(ValueError, match="malformed state"):
        Detectors().load_state_dict({"series": 3})


def test_bad_config_and_garbage_values():
    with pytest.raises(ValueError, match="detectors.cliff.action"):
        DetectorConfig(cliff=CliffConfig(action="explode"))
    det = Detectors()
    assert det.update(0, {"step": 0, "eval/em": float("nan"), "reward/mean": "x", "tools/per_question": None}) == []


def _replay(run_name: str, overrides: list[str]) -> list[dict]:
    """scripts/replay_detectors.py's alerts for the committed run results/<run_name>."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("replay_detectors", repo / "scripts" / "replay_detectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.replay(repo / "results" / run_name, overrides)


def test_replay_of_a_committed_collapse_raises_the_cliff_where_the_fixed_loop_would():
    # results/issue12/composition-lr6e-5-collapsed: post-SFT eval at step 20 (EM 0.48), 6 RL steps,
    # final eval at step 26 (EM 0.00). Fed the post-SFT eval first, the cliff fires at 26.
    alerts = _replay("issue12/composition-lr6e-5-collapsed", [])
    cliffs = [a for a in alerts if a["kind"] == "cliff"]
    assert [(a["step"], a["evidence"]["peak"], a["evidence"]["peak_step"], a["evidence"]["eval/em"]) for a in cliffs] == [(26, 0.48, 20, 0.0)]


def test_a_tag_whose_kl_rises_from_nothing_to_thousandths_is_not_a_spike():
    # A healthy run: a tag's KL sits at ~1e-8 nats and rises to 0.02 — a robust z of millions
    # against a median of ~0, and no collapse. Only the floor min_tag_kl (0.05) keeps it quiet.
    lines = [{"step": s, "kl/tag/<answer>": 1e-8 * (1 + s % 3)} for s in range(12)] + [{"step": 12, "kl/tag/<answer>": 0.02}]
    assert run(lines) == []
    cfg = DetectorConfig()
    cfg.kl_spike.min_tag_kl = 0.0
    alerts = run(lines, Detectors(cfg))
    assert [(a.kind, a.step) for a in alerts] == [("kl_spike", 12)] and alerts[0].evidence["series"]["kl/tag/<answer>"]["robust_z"] > 1e5


@pytest.mark.parametrize("run_name, overrides, before, after", [
    # healthy SFT → GRPO runs (dev EM 0.48 → 0.98): alerts on <answer>, </answer>, <tool_call> at
    # 1e-8 – 0.02 nats without the floor, none with it
    ("paperA-kg/kg_sft_grpo-s0", [], [19, 20], []),
    ("main/main-seg-s0", ["detectors.kl_spike.min_history=4"], [13, 14, 16], []),
    # the R-selfV collapse: <answer> 1.21 nats/token against a median of 0.019, kept
    ("ladder/ladder_r_selfv-s0", [], [4, 7], [4]),
])
def test_kl_spike_floor_on_committed_runs(run_name, overrides, before, after):
    def spikes(more):
        return [a["step"] for a in _replay(run_name, overrides + more) if a["kind"] == "kl_spike"]

    assert spikes(["detectors.kl_spike.min_tag_kl=0"]) == before
    assert spikes([]) == after
