"""`diagnose` on hand-made run directories (one per failure mode, healthy, partial, metrics-only,
garbage), and the per-episode metrics it builds on."""

from __future__ import annotations

import json
import random

import pytest

from keel.diagnostics.classify import diagnose, format_diagnosis
from keel.diagnostics.episode_metrics import (
    correct_counts,
    episode_record,
    eval_metrics,
    mean_pass_at_k,
    pass_at_k,
    tool_lift,
    tool_metrics,
)
from keel.types import Observation, Step, Task, ToolCall, Trajectory

SPOUSE, BIRTH = "people.person.spouse_s", "people.person.place_of_birth"
TASK = Task(id="q", question="?", answers=["Honolulu"], aliases=["Honolulu, Hawaii"], topic_entities={"m.x": "X"})
CALL_TEXT = '<tool_call>\n{"name": "get_tail_entities", "arguments": {"entity": "m.x", "relation": "r"}}\n</tool_call>'


def step(verb, obs, error=None, obs_error=None, **args):
    return Step(0, ToolCall(verb, args, error=error), Observation(obs, ok=obs_error is None and obs != "[]", error=obs_error))


def traj(steps, answer, texts, task_id="q"):
    return Trajectory(task_id=task_id, token_ids=[], sources=[], logprobs=[], turn_texts=texts, steps=steps, answer=answer)


# --- episode metrics ------------------------------------------------------------------------------


def test_episode_record_and_means():
    good = traj([step("get_tail_entities", '["Michelle (m.s)"]', entity="m.x", relation=SPOUSE),
                 step("get_tail_entities", '["Honolulu (m.hon)"]', entity="m.s", relation=BIRTH)],
                "Honolulu", [CALL_TEXT, CALL_TEXT, "<answer>Honolulu</answer>"])
    memory = traj([step("get_tail_relations", f'["{SPOUSE}"]', entity="m.x"), step("get_tail_relations", f'["{SPOUSE}"]', entity="m.x"),
                   step("", "ERROR: bad call", error="bad_json"), step("get_tail_entities", "[]", obs_error="unknown_entity", entity="m.q", relation="r")],
                  "Honolulu", [CALL_TEXT, "<answer>Honolulu</answer>"])
    broken = traj([], "Paris", ["Paris"])
    r_good, r_memory, r_broken = (episode_record(t, TASK) for t in (good, memory, broken))
    assert {k: r_good[k] for k in ("em", "f1", "answered", "format_valid", "cvt", "tools", "valid_calls", "empty_results", "distinct_nonempty")} == {
        "em": 1.0, "f1": 1.0, "answered": 1.0, "format_valid": 1.0, "cvt": 1.0, "tools": 2, "valid_calls": 2, "empty_results": 0, "distinct_nonempty": 2}
    # Correct from memory: the answer is in no tool output → CvT 0; one call did not parse → format invalid;
    # valid calls: 2 relation calls + the unknown-entity query (executed, empty) = 3 of 4; empty: error text and [] = 2;
    # distinct non-empty: the two relation calls are the same signature → 1.
    assert (r_memory["em"], r_memory["cvt"], r_memory["format_valid"], r_memory["valid_calls"], r_memory["empty_results"], r_memory["distinct_nonempty"]) == (1.0, 0.0, 0.0, 3, 2, 1)
    assert r_memory["verbs"] == {"get_tail_relations": 2, "<unparsed>": 1, "get_tail_entities": 1}
    assert r_memory["errors"] == {"bad_json": 1, "unknown_entity": 1}
    assert (r_broken["answered"], r_broken["em"]) == (0.0, 0.0)
    records = [r_good, r_memory, r_broken]
    assert eval_metrics(records) == {
        "eval/em": pytest.approx(2 / 3), "eval/f1": pytest.approx(2 / 3), "eval/format_valid": pytest.approx(1 / 3),
        "eval/answered": pytest.approx(2 / 3), "eval/tools_per_question": 2.0, "eval/cvt": pytest.approx(1 / 3), "eval/n": 3.0}
    # 6 calls: valid 5/6, empty 2/6; distinct non-empty per episode (2 + 1 + 0) / 3 = 1.
    assert tool_metrics(records) == {
        "tools/per_question": 2.0, "tools/distinct_nonempty": 1.0, "tools/valid_call_share": pytest.approx(5 / 6),
        "tools/empty_result_share": pytest.approx(2 / 6), "tools/error/bad_json": 1.0, "tools/error/unknown_entity": 1.0}
    assert "tools/valid_call_share" not in tool_metrics([r_broken]) and eval_metrics([]) == {}
    # Whole-word match: "Honolulu" is not found inside "Honolulus".
    near = traj([step("get_tail_entities", '["Honolulus (m.h)"]', entity="m.x", relation="r")], "Honolulu", ["<answer>Honolulu</answer>"])
    assert episode_record(near, TASK)["cvt"] == 0.0


def test_pass_at_k_and_tool_lift():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 − C(3,2)/C(4,2) = 1 − 3/6
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 1, 16) == 1.0 and pass_at_k(5, 4, 2) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for bad in ((4, 5, 2), (4, 1, 0), (4, 1, 5), (4.0, 1, 2)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(*bad)
    recs = [{"task_id": "a", "em": 1.0}, {"task_id": "a", "em": 0.0}, {"task_id": "b", "em": 0.0}, {"task_id": "b", "em": 0.0}]
    assert correct_counts(recs) == {"a": (2, 1), "b": (2, 0)}
    with_tools = {"a": (4, 1), "b": (4, 2)}  # pass@2: 0.5 and 1 − C(2,2)/C(4,2) = 5/6
    without = {"a": (4, 1), "b": (4, 0)}  # 0.5 and 0
    assert mean_pass_at_k(with_tools, 2) == pytest.approx((0.5 + 5 / 6) / 2)
    assert tool_lift(with_tools, without, 2) == pytest.approx((0.5 + 5 / 6) / 2 - 0.25)
    with pytest.raises(ValueError, match="different questions"):
        tool_lift(with_tools, {"a": (4, 1)}, 2)


# --- run directories ------------------------------------------------------------------------------


def write_run(path, metrics, samples=None, evals=None, alerts=None, tail=""):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
        f.write(tail)
    for step, trajs in (samples or {}).items():
        (path / "samples").mkdir(exist_ok=True)
        (path / "samples" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajs))
    for step, rows in (evals or {}).items():
        (path / "eval").mkdir(exist_ok=True)
        (path / "eval" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if alerts:
        (path / "alerts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alerts))
    return path


def history(n=301, seed=0, em=lambda s: 0.35, tools=lambda s: 2.5, entropy=lambda s: 1.2, share=lambda s: 0.15,
            balance=lambda s: 0.0, broken=lambda s: 0.05, drift=lambda s: 0.0, extra=lambda s: {}):
    rng = random.Random(seed)
    lines = []
    for s in range(n):
        line = {"step": s, "phase": "rl", "reward/mean": 0.5 + rng.gauss(0, 0.03),
                "tools/per_question": max(0.0, tools(s) + rng.gauss(0, 0.05)), "tokens/entropy": entropy(s) + rng.gauss(0, 0.02),
                "kl/control_share": share(s) + rng.gauss(0, 0.01), "tokens/tag_balance": balance(s),
                "collapse/text_pollution": broken(s) / 2, "collapse/full_collapse": broken(s) / 2, "collapse/format_drift": drift(s)}
        if s % 50 == 0:
            line.update({"eval/em": em(s), "eval/tools_per_question": tools(s)})
        line.update(extra(s))
        lines.append(line)
    return lines


GOLD = traj([step("get_tail_entities", '["Michelle (m.s)"]', entity="m.x", relation=SPOUSE),
             step("get_head_entities", '["Honolulu (m.hon)"]', entity="m.s", relation=BIRTH)],
            "Honolulu", [CALL_TEXT, CALL_TEXT, "<answer>Honolulu</answer>"])
QUOTE = traj([step("get_tail_entities", '["Michelle (m.s)", "Other (m.o)"]', entity="m.x", relation=SPOUSE)], "Michelle", [CALL_TEXT, "<answer>Michelle</answer>"])
RITUAL = traj([step("get_tail_relations", f'["{SPOUSE}", "{BIRTH}"]', entity="m.x")], "Honolulu", [CALL_TEXT, "<answer>Honolulu</answer>"])
DRIFT = traj([], "Honolulu", ["<think>look up <search>get_tail_relations(m.x)</search></think><answer>Honolulu</answer>"])
SPAM = traj([], None, ["<tool_call><tool_call><tool_call><tool_call>"])
NOTHING = traj([], "", ["ok ok ok ok ok"])


def cliff_metrics(seed=0):
    evals = {0: 0.2, 50: 0.3, 100: 0.35, 150: 0.37, 200: 0.38, 250: 0.395, 300: 0.0}
    return history(seed=seed, em=lambda s: evals[s], tools=lambda s: 3.0 if s <= 250 else 3.0 - 2.0 * (s - 250) / 50)


def test_healthy(tmp_path):
    d = diagnose(write_run(tmp_path / "run", history(em=lambda s: 0.3 + s / 5000), samples={300: [GOLD] * 4}))
    assert d["mode"] == "healthy" and d["confidence"] >= 0.8
    assert json.loads((tmp_path / "run" / "diagnosis.json").read_text()) == d
    assert not (tmp_path / "run" / ".diagnosis.json.tmp").exists()


def test_spec_gaming_cliff_with_and_without_samples(tmp_path):
    full = diagnose(write_run(tmp_path / "full", cliff_metrics(), samples={250: [GOLD] * 4, 300: [QUOTE] * 3 + [GOLD]}))
    assert full["mode"] == "spec_gaming_cliff"
    assert full["evidence"]["steps"] == {"peak": 250, "collapse": 300}
    assert full["evidence"]["examples"][0]["snippet"].startswith("<tool_call>")
    only_metrics = diagnose(write_run(tmp_path / "metrics_only", cliff_metrics()))
    assert only_metrics["mode"] == "spec_gaming_cliff"
    # Every signal holds in both; without samples the quote-and-stop signal (weight 1 of 7) is
    # unknown: confidence 1 × (0.6 + 0.4 × 6/7) = 0.943 instead of 1 × (0.6 + 0.4 × 7/7) = 1.
    assert full["confidence"] == 1.0
    assert only_metrics["confidence"] == pytest.approx(0.6 + 0.4 * 6 / 7, abs=1e-4)
    assert "spec_gaming_cliff" in format_diagnosis(full) and "[+] EM cliff" in format_diagnosis(full)


def test_sparse_format_collapse(tmp_path):
    lines = history(em=lambda s: 0.1 if s < 50 else 0.0, tools=lambda s: max(0.0, 2.0 - s / 25), entropy=lambda s: 1.2 if s < 50 else 0.15,
                    extra=lambda s: {"eval/answered": 0.0} if s % 50 == 0 and s > 0 else {})
    d = diagnose(write_run(tmp_path / "run", lines, samples={300: [NOTHING] * 4}))
    assert d["mode"] == "sparse_format_collapse" and d["confidence"] >= 0.9


def test_answers_vanishing_while_calls_rise_is_mode_1_not_the_cliff(tmp_path):
    # The shape of results/issue12/composition-lr6e-5-collapsed (R-binary, GRPO at 6e-5 after SFT):
    # EM 0.48 → 0 inside one eval window, but calls *rose* to the turn limit (2.0 → 4.04) and the
    # answers vanished (answered 0.98 → 0.04): paper B's mode 1 ("<answer> disappears, EM 0"),
    # not mode 4, whose signature is the call volume falling to ~1.
    evals = {0: (0.48, 2.0, 0.98), 50: (0.0, 4.04, 0.04)}
    lines = history(n=51, em=lambda s: evals[s][0], tools=lambda s: 2.0 if s < 25 else 4.0,
                    extra=lambda s: {"eval/tools_per_question": evals[s][1], "eval/answered": evals[s][2]} if s in evals else {})
    d = diagnose(write_run(tmp_path / "run", lines))
    assert d["evidence"]["scores"]["spec_gaming_cliff"]["qualifies"] is False
    assert d["mode"] == "sparse_format_collapse"
    signals = {s["signal"]: s["satisfied"] for s in d["evidence"]["signals"]}
    assert signals["answered share ≤ 0.5"] and signals["EM ≈ 0 (≤ 0.02)"] and not signals["tools/question ≈ 0 (≤ 0.1)"]
    # The same history with the calls falling to 1 instead is the cliff.
    evals = {0: (0.48, 3.0, 0.98), 50: (0.0, 1.0, 0.98)}
    d = diagnose(write_run(tmp_path / "cliff", history(n=51, em=lambda s: evals[s][0], tools=lambda s: 3.0 if s < 25 else 1.0,
                                                        extra=lambda s: {"eval/tools_per_question": evals[s][1], "eval/answered": evals[s][2]} if s in evals else {})))
    assert d["mode"] == "spec_gaming_cliff"


def eval_only(ems, tools, entropy, every=50):
    """A history like paper B's monitored runs: eval-only lines, 50 steps apart."""
    return [{"step": i * every, "eval/em": em, "eval/f1": em, "eval/cvt": em / 2, "eval/tools_per_question": t, "tokens/entropy": h}
            for i, (em, t, h) in enumerate(zip(ems, tools, entropy))]


def test_eval_only_histories_of_the_three_shapes_once_missed(tmp_path):
    # EM ≈ 0 for the whole run at very low entropy (some calls still made): mode 1, not healthy.
    d = diagnose(write_run(tmp_path / "never", eval_only([0.0, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.8, 0.6, 0.6, 0.5, 0.5, 0.5], [0.05] * 7)))
    assert d["mode"] == "sparse_format_collapse"
    # EM rises to a peak, then falls to 0 while calls stop parsing (tools/question → 0): drift, not
    # the cliff, whose calls fall to about one.
    d = diagnose(write_run(tmp_path / "drift", eval_only([0.1, 0.25, 0.33, 0.38, 0.2, 0.0, 0.0], [2.5, 2.6, 2.4, 2.0, 0.6, 0.0, 0.0], [1.2, 1.1, 1.0, 0.9, 0.4, 0.2, 0.2])))
    assert d["mode"] == "format_drift"
    assert d["evidence"]["scores"]["spec_gaming_cliff"]["qualifies"] is False
    # Three evaluations, EM falling from the first to 0 over two windows: a collapse, not healthy.
    d = diagnose(write_run(tmp_path / "short", eval_only([0.3, 0.15, 0.0], [2.0, 2.0, 2.0], [0.8, 0.7, 0.6])))
    assert d["mode"] == "sparse_format_collapse"
    # The paper's mode-4 run, eval-only: peak 0.395, then 0 inside one window with calls 3 → 1.
    d = diagnose(write_run(tmp_path / "cliff", eval_only([0.2, 0.3, 0.35, 0.37, 0.38, 0.395, 0.0], [3.0] * 6 + [1.0], [1.2] * 7)))
    assert d["mode"] == "spec_gaming_cliff"
    # Our R-selfV run at lr 6e-5 (results/ladder/ladder_r_selfv-s0): EM fell a window before the
    # calls did (EM 0.60 → 0 at step 2 with 2.0 calls; 1.0 call from step 4 on): still mode 4.
    d = diagnose(write_run(tmp_path / "calls_later", eval_only([0.6, 0.0, 0.0, 0.0, 0.0], [2.2, 2.0, 1.0, 1.0, 1.0], [0.02] * 5, every=2)))
    assert d["mode"] == "spec_gaming_cliff"
    # EM alone, no call counts anywhere: the cliff stands on EM (its call signal is unknown).
    d = diagnose(write_run(tmp_path / "em_only", [{"step": 0, "eval/em": 0.5}, {"step": 50, "eval/em": 0.0}]))
    assert d["mode"] == "spec_gaming_cliff"
    # A healthy eval-only run stays healthy.
    d = diagnose(write_run(tmp_path / "healthy", eval_only([0.1, 0.2, 0.25, 0.3, 0.3, 0.32, 0.33], [2.5] * 7, [1.0] * 7)))
    assert d["mode"] == "healthy"


def test_a_cliff_from_a_plateau_below_the_peak_is_mode_4(tmp_path):
    # results/claim6/ladder_r_selfv-s2's evals: EM 0.60 → 0.30, 0.36, then 0 inside one window as
    # the calls fell 2.04 → 1.0 (quote-and-stop in 4 of 4 final samples): mode 4 from a plateau at
    # 60% of the start; it was scored control_token_collapse while a cliff had to start within 0.1
    # of the peak.
    ems, tools = [0.6, 0.3, 0.36, 0.0, 0.0], [2.2, 2.0, 2.04, 1.0, 1.0]
    d = diagnose(write_run(tmp_path / "plateau", eval_only(ems, tools, [0.02] * 5, every=2)))
    assert d["mode"] == "spec_gaming_cliff"
    assert d["evidence"]["steps"] == {"peak": 0, "collapse": 6}
    # Not a cliff: the same end reached by a slow decline (the eval before held less than half the
    # peak), or a plateau at half the peak that lost only half of itself in the window.
    d = diagnose(write_run(tmp_path / "decline", eval_only([0.6, 0.4, 0.25, 0.1, 0.0], tools, [0.02] * 5, every=2)))
    assert d["evidence"]["scores"]["spec_gaming_cliff"]["qualifies"] is False
    d = diagnose(write_run(tmp_path / "halving", eval_only([0.6, 0.3, 0.3, 0.15], [2.2, 2.0, 2.0, 1.0], [0.02] * 4, every=2)))
    assert d["evidence"]["scores"]["spec_gaming_cliff"]["qualifies"] is False


def test_a_fall_no_signature_fits_is_an_unnamed_collapse_not_healthy(tmp_path):
    # results/claim6/ladder_r_selfv-s1's evals: EM 0.60 → 0 → 0.22 → 0.10 → 0.16 with two calls
    # a question throughout and answers kept: lost 44 points (p = 3e-6), and no mode's required
    # signals hold (EM not ≈ 0 at the end; calls never near one).
    ems, tools = [0.6, 0.0, 0.22, 0.1, 0.16], [2.2, 1.96, 2.0, 2.0, 1.88]
    d = diagnose(write_run(tmp_path / "fell", eval_only(ems, tools, [0.02] * 5, every=2)))
    assert d["mode"] == "unnamed_collapse"
    assert not any(v["qualifies"] for v in d["evidence"]["scores"].values())
    assert d["evidence"]["signals"][0]["value"] == 0.16 and "0.6 (step 0)" in d["evidence"]["signals"][0]["signal"]
    assert d["evidence"]["steps"] == {"peak": 0, "collapse": 2}  # the one-window fall at step 2
    # The bounds: ending at 0.31 after a 0.6 peak keeps more than half (healthy), 0.30 does not;
    # a fall of less than 0.1 from a low peak is noise, not a collapse.
    assert diagnose(write_run(tmp_path / "half", eval_only([0.6, 0.5, 0.31], [2.0] * 3, [1.0] * 3)))["mode"] == "healthy"
    assert diagnose(write_run(tmp_path / "halved", eval_only([0.6, 0.5, 0.30], [2.0] * 3, [1.0] * 3)))["mode"] == "unnamed_collapse"
    assert diagnose(write_run(tmp_path / "low", eval_only([0.12, 0.14, 0.05], [2.0] * 3, [1.0] * 3)))["mode"] == "healthy"


def test_ritual(tmp_path):
    lines = history(em=lambda s: 0.325, tools=lambda s: 1.0, extra=lambda s: {"eval/cvt": 0.0003, "eval/tool_lift": 0.0} if s % 50 == 0 else {})
    d = diagnose(write_run(tmp_path / "run", lines, samples={300: [RITUAL] * 5}))
    assert d["mode"] == "ritual" and d["confidence"] >= 0.9
    top = next(s for s in d["evidence"]["signals"] if s["signal"].startswith("one verb"))
    assert top["value"] == 1.0 and top["satisfied"]
    # Eval records alone supply the verb share when there are no samples.
    rows = [episode_record(RITUAL, TASK)] * 3
    d2 = diagnose(write_run(tmp_path / "evals_only", lines, evals={300: rows}))
    assert d2["mode"] == "ritual"


def test_format_drift(tmp_path):
    lines = history(drift=lambda s: 0.0 if s < 150 else 0.6, entropy=lambda s: 1.2 if s < 150 else 0.3, tools=lambda s: 2.5 if s < 150 else 0.5)
    d = diagnose(write_run(tmp_path / "run", lines, samples={300: [DRIFT] * 3 + [GOLD]}))
    assert d["mode"] == "format_drift"
    assert d["evidence"]["examples"][0]["snippet"].startswith("<think>look up <search>")


def test_control_token_collapse(tmp_path):
    lines = history(share=lambda s: 0.12 if s < 200 else 0.8, balance=lambda s: 0.0 if s < 200 else 0.4,
                    broken=lambda s: 0.05 if s < 200 else 0.7, em=lambda s: 0.3 if s < 250 else 0.02)
    d = diagnose(write_run(tmp_path / "run", lines, samples={0: [GOLD] * 4, 300: [SPAM, SPAM, NOTHING, GOLD]},
                           alerts=[{"step": 200, "kind": "kl_spike", "evidence": {}}]))
    assert d["mode"] == "control_token_collapse" and d["confidence"] >= 0.9
    assert d["evidence"]["alerts"] == {"kl_spike": 1}
    assert len(d["evidence"]["examples"]) == 3


def test_partial_garbage_and_empty_dirs(tmp_path):
    # The first 120 steps of the cliff run, a torn last line and garbage in between: no cliff yet.
    lines = cliff_metrics()[:120]
    path = write_run(tmp_path / "partial", lines[:60], tail="")
    with open(path / "metrics.jsonl", "a") as f:
        f.write("not json at all\n[1, 2]\n\n")
        for m in lines[60:]:
            f.write(json.dumps(m) + "\n")
        f.write('{"step": 120, "eval/em": 0.')  # torn
    (path / "samples").mkdir()
    (path / "samples" / "step_000100.jsonl").write_text('{"task_id": "q"}\n{"broken\n')
    d = diagnose(path)
    assert d["mode"] == "healthy" and d["evidence"]["read"]["metrics_lines"] == 120
    assert d["evidence"]["bad_lines"] == {"metrics.jsonl": 3, "samples/step_000100.jsonl": 2}
    assert "skipped unreadable lines" in format_diagnosis(d)
    short = diagnose(write_run(tmp_path / "short", lines[:5]))
    assert short["mode"] == "healthy" and short["confidence"] < d["confidence"]
    (tmp_path / "empty").mkdir()
    assert diagnose(tmp_path / "empty")["confidence"] == 0.0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        diagnose(tmp_path / "nope")


def test_kl_on_control_tokens_while_em_rises_is_not_a_collapse(tmp_path):
    # results/issue12/main-s1-from-sft-lr1e-5-8steps in kind: control-tag KL share 0.12 → 0.8
    # while dev EM rose 0.30 → 0.45 and nothing broke: no collapse to name.
    rising = history(share=lambda s: 0.12 if s < 200 else 0.8, em=lambda s: 0.3 if s < 200 else 0.45)
    d = diagnose(write_run(tmp_path / "rising", rising))
    assert d["mode"] == "healthy"
    assert d["evidence"]["scores"]["control_token_collapse"]["qualifies"] is False
    # The same KL history with EM falling 0.3 → 0.15 (≥ 0.1 below the peak) is paper A's collapse.
    falling = history(share=lambda s: 0.12 if s < 200 else 0.8, em=lambda s: 0.3 if s < 200 else 0.15)
    assert diagnose(write_run(tmp_path / "falling", falling))["mode"] == "control_token_collapse"


def test_em_at_zero_with_calls_and_answers_intact_is_not_mode_1(tmp_path):
    # results/claim1/claim1-lr4e-5-s0: one update took EM 0.48 → 0; the policy still makes two
    # calls and answers every question (with the relation name it read); no group had a mixed
    # reward after it, so the updates trained nothing and logged entropy 0.0 (not a measurement).
    def lines(answered):
        out = [{"step": 8, "phase": "eval", "eval/em": 0.48, "eval/tools_per_question": 2.0, "eval/answered": 1.0}]
        for s in range(9, 25):
            out.append({"step": s, "phase": "rl", "loss/trained_members": 16.0 if s == 9 else 0.0, "tokens/entropy": 0.0148 if s == 9 else 0.0,
                        "tools/per_question": 2.0})
            if s % 2 == 0:
                out.append({"step": s, "phase": "eval", "eval/em": 0.0, "eval/tools_per_question": 2.0, "eval/answered": answered})
        return out

    d = diagnose(write_run(tmp_path / "answers", lines(answered=1.0)))
    assert d["mode"] == "unnamed_collapse"
    assert d["evidence"]["scores"]["sparse_format_collapse"]["qualifies"] is False
    # the same run whose answers vanished is mode 1
    d = diagnose(write_run(tmp_path / "silent", lines(answered=0.04)))
    assert d["mode"] == "sparse_format_collapse"
    entropy = next(s for s in d["evidence"]["signals"] if s["signal"].startswith("entropy"))
    assert entropy["value"] == 1.0 and entropy["satisfied"] is False  # the untrained steps' 0.0 left out


def test_warning_times_the_first_train_step_alert_against_the_eval_that_showed_the_fall(tmp_path):
    # results/claim6/lr2e-5/ladder_r_selfv-lr2e-5-s2's shape: kl_spike at 5, EM 0.60 → 0.50 → 0.00
    # at the evals of steps 0, 3, 6, the cliff (eval-driven) and call_volume on the eval's calls at
    # 6, and a training reward that never fell to half its first value.
    ems = {0: 0.6, 3: 0.5, 6: 0.0}
    rewards = [0.5, 0.6, 0.5, 0.6, 0.7, 0.6]
    lines = [{"step": 0, "eval/em": 0.6}] + [{"step": s, "reward/mean": rewards[s - 1]} | ({"eval/em": ems[s]} if s in ems else {}) for s in range(1, 7)]
    alerts = [{"step": 5, "kind": "kl_spike", "evidence": {"series": {"kl/tag/<tool_call>": {"value": 0.078}}}},
              {"step": 6, "kind": "cliff", "evidence": {}},
              {"step": 6, "kind": "call_volume", "evidence": {"series": "eval/tools_per_question"}}]
    w = diagnose(write_run(tmp_path / "warned", lines, alerts=alerts))["evidence"]["warning"]
    assert w == {"fall_step": 6, "fall": [0.5, 0.0], "previous_eval_step": 3,
                 "warnings": [{"step": 5, "kind": "kl_spike", "on": ["kl/tag/<tool_call>"]}],
                 "first_warning_step": 5, "lead_steps": 1, "reward_fell_step": None, "reward_first": 0.5}
    text = format_diagnosis(diagnose(tmp_path / "warned"))
    assert "warning: first train-step alert kl_spike on kl/tag/<tool_call> at step 5, 1 step(s) before the eval that showed the fall (step 6: EM 0.5 → 0.0" in text

    # A run that fell, recovered and fell again is timed from its last fall: the peak is the best
    # eval since the first fall (0.5 at step 4), an alert before it does not count, and the reward
    # is judged from its first value after that peak (0.4 at step 5 → 0.1 at step 6).
    ems = {0: 0.6, 2: 0.1, 4: 0.5, 6: 0.0}
    rewards = {1: 0.5, 2: 0.1, 3: 0.3, 4: 0.4, 5: 0.4, 6: 0.1}
    lines = [{"step": 0, "eval/em": 0.6}] + [{"step": s, "reward/mean": rewards[s]} | ({"eval/em": ems[s]} if s in ems else {}) for s in range(1, 7)]
    alerts = [{"step": 3, "kind": "kl_spike", "evidence": {"series": {"kl/control_share": {}}}}, {"step": 5, "kind": "entropy", "evidence": {}},
              {"step": 6, "kind": "call_volume", "evidence": {"series": "tools/per_question"}}]
    w = diagnose(write_run(tmp_path / "twice", lines, alerts=alerts))["evidence"]["warning"]
    assert (w["fall_step"], w["fall"], w["previous_eval_step"]) == (6, [0.5, 0.0], 4)
    assert w["warnings"] == [{"step": 5, "kind": "entropy"}, {"step": 6, "kind": "call_volume"}]
    assert (w["first_warning_step"], w["lead_steps"], w["reward_fell_step"], w["reward_first"]) == (5, 1, 6, 0.4)

    # No alert before a one-update collapse; none of this for a run whose EM never fell.
    lines = [{"step": 0, "eval/em": 0.6}, {"step": 1, "reward/mean": 0.69}, {"step": 2, "reward/mean": 0.12, "eval/em": 0.08}]
    w = diagnose(write_run(tmp_path / "sudden", lines, alerts=[{"step": 2, "kind": "cliff", "evidence": {}}]))["evidence"]["warning"]
    assert (w["warnings"], w["first_warning_step"], w["lead_steps"], w["reward_fell_step"]) == ([], None, None, 2)
    assert "no train-step alert before the eval that showed the fall (step 2: EM 0.6 → 0.08" in format_diagnosis(diagnose(tmp_path / "sudden"))
    assert diagnose(write_run(tmp_path / "held", [{"step": 0, "eval/em": 0.6}, {"step": 2, "eval/em": 0.55}]))["evidence"]["warning"] == {}
