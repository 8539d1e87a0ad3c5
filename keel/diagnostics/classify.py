"""Name the failure mode of a run from its directory: `diagnose(run_dir)`.

Paper B named four failure modes from plots and samples after the fact (sparse-reward format
collapse, verify-then-answer ritual, format drift, specification-gaming cliff); paper A named
control-token collapse. This module checks each mode's signature on what a Keel run writes
and says which fits, with evidence and a confidence. The rules are Keel's reading of the
papers; each is a list of signals (below, in `_signals`), some required.

Inputs, all optional and read tolerantly (a torn or garbage line is skipped and counted):
`metrics.jsonl`, `alerts.jsonl`, `samples/step_XXXXXX.jsonl` (Trajectory dicts),
`eval/step_XXXXXX.jsonl` (episode records); `summary.json` and `config.yaml` are not needed.
"Late" / "early" values are means over the last / first 20% of logged points.

Required signals per mode (the others add to the score):
- sparse_format_collapse: late EM ≤ 0.02, EM never rose ≥ 0.05 above the run's first eval, and,
  where both were measured, one of its faces: tools/question ≤ 0.1 or answered share ≤ 0.5
  (paper B's table: "`<answer>` disappears, EM 0", its text: "no tool calls"; each scored, with
  entropy halved — steps whose update trained no token carry no entropy);
- ritual: late tools/question in (0.5, 1.5] and late EM ≥ 0.05 (scored: CvT ≤ 0.01, tool lift
  ≈ 0, one verb ≥ 90% of calls);
- format_drift: late `collapse/format_drift` (or the samples' share) ≥ 0.2, or, where no drift
  share was measured (eval-only histories), EM rose, then fell to ≤ 30% of its peak while
  tools/question fell to ≤ 0.1 (calls no longer parsed);
- spec_gaming_cliff: an eval where EM ≤ 30% of its running peak (≥ 0.1) right after an eval
  within 0.1 of the peak, or after one that held ≥ half the peak and fell to ≤ 30% of itself,
  and, where tools/question was recorded there, calls falling to about one (0.5–1.5) and ≤ 60%
  of before, at the cliff or by the end (scored: entropy not halved; quote-and-stop samples);
- control_token_collapse: peak `kl/control_share` ≥ 0.5 and ≥ 2× early, or the pollution +
  full-collapse share up by ≥ 0.2; and harm: dev EM ended ≥ 0.1 below its peak, or that
  structural breakdown (a concentration while EM held or rose is not a collapse).
A mode wins when all its required signals hold; among winners the highest share of satisfied
signals wins. Confidence = score × (0.6 + 0.4 × coverage), coverage = the weight of signals
that could be evaluated, so a directory with metrics alone gets a lower confidence than one
with samples too. With no mode qualifying, a run whose dev EM ended at ≤ 50% of its peak (peak
≥ 0.1, a fall of ≥ 0.1) is an "unnamed_collapse" — it broke, and none of the papers' signatures
fits (e.g. results/claim6/ladder_r_selfv-s1: 0.60 → 0.16 with calls held at two); otherwise it
is "healthy". Both verdicts by absence are as confident as the number of signal families that
were there to look at.

Whatever the mode, `evidence.warning` times the run's last fall of dev EM against the alerts:
the first train-step alert (KL spike, entropy, format drift, proxy gaming, training call volume)
after the peak and at or before the eval that showed the fall, its lead in steps, and the step
the training reward fell to half its first value after the peak — paper A's claim 1 asks for
an alert before the score shows the collapse.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from keel.answers import normalise
from keel.diagnostics.episode_metrics import eval_metrics
from keel.diagnostics.states import has_format_drift, structural_shares
from keel.metrics import (
    COLLAPSE_FORMAT_DRIFT,
    COLLAPSE_FULL,
    COLLAPSE_TEXT_POLLUTION,
    EVAL_ANSWERED,
    EVAL_CVT,
    EVAL_EM,
    EVAL_TOOL_LIFT,
    EVAL_TOOLS_PER_QUESTION,
    KL_CONTROL_SHARE,
    LOSS_TRAINED_MEMBERS,
    REWARD_MEAN,
    TOKENS_ENTROPY,
    TOKENS_TAG_BALANCE,
    TOOLS_PER_QUESTION,
)
from keel.rewards import is_empty_observation, returned_entities
from keel.rundir import atomic_write_text, read_jsonl, read_run
from keel.types import Trajectory

MODES = ("healthy", "unnamed_collapse", "control_token_collapse", "sparse_format_collapse", "ritual", "format_drift", "spec_gaming_cliff")
# Tie-break among modes with equal scores: the more specific signature first.
PRIORITY = ("spec_gaming_cliff", "control_token_collapse", "format_drift", "sparse_format_collapse", "ritual")
TAIL_FRACTION = 0.2  # "late" / "early" = the last / first 20% of logged steps


# --- reading ------------------------------------------------------------------------------------


class RunData:
    """Everything `diagnose` reads from a run directory (keel.rundir.read_run), samples parsed."""

    def __init__(self, run_dir: Path) -> None:
        files = read_run(run_dir)
        self.bad_lines: dict[str, int] = {name: len(problems) for name, problems in files.problems.items()}
        self.metrics = sorted((m for m in files.metrics if isinstance(m.get("step"), (int, float)) and not isinstance(m.get("step"), bool)), key=lambda m: m["step"])
        self.alerts = files.alerts
        self.samples: dict[int, list[Trajectory]] = {}
        for step, path in files.samples.items():
            rows, bad = read_jsonl(path)
            trajs = []
            for row in rows:
                try:
                    trajs.append(Trajectory.from_dict(row))
                except (KeyError, TypeError, ValueError, AttributeError):
                    pass
            self.bad_lines[f"samples/{path.name}"] = len(bad) + len(rows) - len(trajs)  # not JSON objects, or not trajectories
            if trajs:
                self.samples[step] = trajs
        self.evals: dict[int, list[dict[str, Any]]] = {}
        for step, path in files.evals.items():
            rows, bad = read_jsonl(path)
            self.bad_lines[f"eval/{path.name}"] = len(bad)
            rows = [r for r in rows if isinstance(r.get("em"), (int, float))]
            if rows:
                self.evals[step] = rows
        self.bad_lines = {k: v for k, v in self.bad_lines.items() if v}

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of a metric, numeric finite values only; eval keys fall back to the
        eval/ files when metrics.jsonl lacks them."""
        out = [(int(m["step"]), float(m[key])) for m in self.metrics if _is_number(m.get(key))]
        if not out and key.startswith("eval/") and self.evals:
            out = [(s, v) for s, rows in sorted(self.evals.items()) if (v := eval_metrics(rows).get(key)) is not None]
        return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _tail(points: list[tuple[int, float]], late: bool = True) -> float | None:
    if not points:
        return None
    n = max(1, round(len(points) * TAIL_FRACTION))
    part = points[-n:] if late else points[:n]
    return statistics.fmean(v for _, v in part)


# --- sample-derived facts -----------------------------------------------------------------------


def _snippet(traj: Trajectory, limit: int = 160) -> str:
    text = traj.text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_quote_and_stop(traj: Trajectory) -> bool:
    """Paper B's mode-4 policy: one call, and the answer is its first returned entity."""
    answer = normalise(traj.answer or "")
    first = returned_entities(traj.steps[0].observation.result_text)[:1] if len(traj.steps) == 1 else []
    return bool(answer) and bool(first) and normalise(first[0]) == answer


def _is_broken(traj: Trajectory) -> bool:
    shares = structural_shares([traj])
    return shares.get(COLLAPSE_TEXT_POLLUTION, 0.0) + shares.get(COLLAPSE_FULL, 0.0) > 0


def _sample_facts(trajs: list[Trajectory]) -> dict[str, Any]:
    verbs = Counter(s.call.name for t in trajs for s in t.steps if s.call.name)
    quote = [t for t in trajs if is_quote_and_stop(t)]
    shares = structural_shares(trajs)
    return {
        "n": len(trajs),
        "tools_per_episode": sum(len(t.steps) for t in trajs) / len(trajs),
        "top_verb": verbs.most_common(1)[0][0] if verbs else None,
        "top_verb_share": verbs.most_common(1)[0][1] / sum(verbs.values()) if verbs else None,
        "quote_and_stop_share": len(quote) / len(trajs),
        "drift_share": shares.get(COLLAPSE_FORMAT_DRIFT, 0.0),
        "broken_share": shares.get(COLLAPSE_TEXT_POLLUTION, 0.0) + shares.get(COLLAPSE_FULL, 0.0),
        "empty_result_share": (sum(is_empty_observation(s.observation.result_text) for t in trajs for s in t.steps) / max(1, sum(len(t.steps) for t in trajs))),
    }


# --- signals ------------------------------------------------------------------------------------


def _signal(name: str, value: Any, test: bool | None, weight: float = 1.0, required: bool = False) -> dict[str, Any]:
    """One piece of evidence; `test` None = not available from this directory."""
    return {"signal": name, "value": value, "satisfied": bool(test) if test is not None else None, "weight": weight, "required": required}


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _cliff(em: list[tuple[int, float]]) -> dict[str, Any] | None:
    """The first eval where EM fell to ≤ 30% of its running peak (peak ≥ 0.1) from the eval just
    before, which was within 0.1 of the peak, or held at least half of it and fell to ≤ 30% of
    itself: a fall inside one eval window from where the run stood, not the last step of a slow
    decline. The plateau may sit below the peak: results/claim6/ladder_r_selfv-s2 went 0.60 →
    0.30, 0.36, then 0 in one window as its calls fell to one — mode 4 from a lower plateau."""
    peak_step, peak = None, -1.0
    for i, (step, v) in enumerate(em):
        if i and peak >= 0.1 and v <= 0.3 * peak:
            before = em[i - 1][1]
            if before >= peak - 0.1 or (before >= 0.5 * peak and v <= 0.3 * before):  # near the peak, or a plateau
                return {"peak": peak, "peak_step": peak_step, "step": step, "em": v, "previous_step": em[i - 1][0]}
        if v > peak:
            peak_step, peak = step, v
    return None


def _rose(em: list[tuple[int, float]]) -> bool | None:
    """Did dev EM rise during the run: a later eval ≥ 0.05 above the first? None: fewer than two evals.
    A run's first eval is where it started (the base model, or the SFT warm-start), not learning."""
    if len(em) < 2:
        return None
    return max(v for _, v in em[1:]) >= em[0][1] + 0.05


def _last_against_peak(em: list[tuple[int, float]]) -> dict[str, Any] | None:
    """The last eval against the (first) peak of the evals before it: {"peak", "peak_step",
    "step", "em"}. None with fewer than two evals. Every "fell from its peak" rule reads this."""
    if len(em) < 2:
        return None
    peak_step, peak = max(em[:-1], key=lambda p: (p[1], -p[0]))
    return {"peak": peak, "peak_step": peak_step, "step": em[-1][0], "em": em[-1][1]}


def _fell_from_peak(em: list[tuple[int, float]]) -> bool | None:
    """Is the last eval ≤ 30% of the peak (≥ 0.1) of the evals before it, at any pace."""
    f = _last_against_peak(em)
    return None if f is None else f["peak"] >= 0.1 and f["em"] <= 0.3 * f["peak"]


def _halved(peak: float, em: float) -> bool:
    """Dev EM stands at ≤ 50% of a peak ≥ 0.1 and at least 0.1 below it: the run's score fell."""
    return peak >= 0.1 and em <= 0.5 * peak and peak - em >= 0.1


def _unnamed_fall(em: list[tuple[int, float]]) -> dict[str, Any] | None:
    """The last eval at ≤ 50% of the peak before it (`_halved`): dev EM fell and stayed down,
    whatever the shape. None otherwise, or with fewer than two evals."""
    f = _last_against_peak(em)
    return f if f is not None and _halved(f["peak"], f["em"]) else None


# Alerts a train step can raise before any eval: the cliff reads dev EM, and call_volume on
# eval/tools_per_question reads the eval too, so neither can come before the score shows it.
TRAIN_STEP_ALERTS = ("kl_spike", "entropy", "format_drift", "proxy_gaming", "call_volume")


def _last_fall(em: list[tuple[int, float]]) -> dict[str, Any] | None:
    """The eval that first showed the run's last collapse: evals `_halved` against the running
    peak are "down"; the last stretch of such evals starts at
    the fall, and its peak is the best eval between the stretch before it (if any) and the fall —
    a run that recovered and fell again is timed from its second fall
    (results/claim2b/a-interleaved_sft-s2: 0.60 → 0.14, back to 0.48, then 0.00). Returns
    {"step", "em", "peak", "peak_step", "previous_step", "previous_em"}, or None if no eval was down.
    """
    down, peak = [], -1.0
    for i, (_, v) in enumerate(em):
        down.append(bool(i) and _halved(peak, v))
        peak = max(peak, v)
    if not any(down):
        return None
    start = max(i for i, d in enumerate(down) if d)
    while down[start - 1]:
        start -= 1
    before = max((i for i in range(start) if down[i]), default=-1)
    peak_step, peak = max(em[before + 1 : start], key=lambda p: (p[1], -p[0]))
    step, v = em[start]
    return {"step": step, "em": v, "peak": peak, "peak_step": peak_step, "previous_step": em[start - 1][0], "previous_em": em[start - 1][1]}


def _warning(run: RunData) -> dict[str, Any]:
    """Did an alert come before the dev score showed the collapse (paper A's claim 1 asks it)?

    The fall is `_last_fall`'s eval; warnings are the train-step alerts (TRAIN_STEP_ALERTS,
    call_volume only on the training series) after the peak eval and at or before the fall;
    `lead_steps` = fall step − first warning's step. The training reward "fell" at the first step
    after the peak where `reward/mean` was ≤ half its first value after the peak (None: it never
    did). {} when dev EM never fell.
    """
    fall = _last_fall(run.series(EVAL_EM))
    if fall is None:
        return {}
    warnings = []
    for a in run.alerts:
        step, kind = a.get("step"), a.get("kind")
        if not _is_number(step) or kind not in TRAIN_STEP_ALERTS or not fall["peak_step"] < step <= fall["step"]:
            continue
        series = a["evidence"].get("series") if isinstance(a.get("evidence"), dict) else None
        if kind == "call_volume" and series != TOOLS_PER_QUESTION:
            continue
        on = sorted(series) if kind == "kl_spike" and isinstance(series, dict) else None
        warnings.append({"step": int(step), "kind": kind} | ({"on": on} if on else {}))
    warnings.sort(key=lambda w: w["step"])
    rewards = [(s, v) for s, v in run.series(REWARD_MEAN) if s > fall["peak_step"]]
    reward_fell = next((s for s, v in rewards[1:] if v <= 0.5 * rewards[0][1]), None) if rewards and rewards[0][1] > 0 else None
    first = warnings[0]["step"] if warnings else None
    return {"fall_step": fall["step"], "fall": [_rounded(fall["previous_em"]), _rounded(fall["em"])], "previous_eval_step": fall["previous_step"],
            "warnings": warnings, "first_warning_step": first, "lead_steps": None if first is None else fall["step"] - first,
            "reward_fell_step": reward_fell, "reward_first": _rounded(rewards[0][1]) if rewards else None}


def _value_near(points: list[tuple[int, float]], step: int) -> float | None:
    before = [v for s, v in points if s <= step]
    return before[-1] if before else None


def _signals(run: RunData) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    em = run.series(EVAL_EM)
    tools_eval = run.series(EVAL_TOOLS_PER_QUESTION)
    tools = tools_eval or run.series(TOOLS_PER_QUESTION)
    # a step whose update trained no token writes entropy 0.0 (keel.diagnostics.step_metrics): not a measurement
    untrained = {step for step, n in run.series(LOSS_TRAINED_MEMBERS) if n == 0}
    entropy = [(step, v) for step, v in run.series(TOKENS_ENTROPY) if step not in untrained]
    late_samples = run.samples[max(run.samples)] if run.samples else []
    early_samples = run.samples[min(run.samples)] if run.samples else []
    facts = _sample_facts(late_samples) if late_samples else None
    early_facts = _sample_facts(early_samples) if early_samples and len(run.samples) > 1 else None
    late_em, late_tools = _tail(em), _tail(tools)
    if late_tools is None and facts:
        late_tools = facts["tools_per_episode"]
    late_entropy, early_entropy = _tail(entropy), _tail(entropy, late=False)
    entropy_ratio = late_entropy / early_entropy if late_entropy is not None and early_entropy else None
    context: dict[str, Any] = {"facts": facts}
    out: dict[str, list[dict[str, Any]]] = {}

    answered = _tail(run.series(EVAL_ANSWERED))
    no_calls = None if late_tools is None else late_tools <= 0.1
    answer_gone = None if answered is None else answered <= 0.5
    rose = _rose(em)
    # Mode 1 is the policy that never found the reward: EM ends at ≈ 0 and never rose above where
    # the run started. Paper B's table: "<answer> disappears, EM 0"; its text: "no tool calls,
    # low-entropy output, EM 0" — either face, scored.
    # Where both faces were measured one must show: EM at 0 with calls and answers both intact
    # is a policy answering wrongly (results/claim1/claim1-lr4e-5-s0), not this mode.
    both_known = no_calls is not None and answer_gone is not None
    out["sparse_format_collapse"] = [
        _signal("no calls or no answers", None, (no_calls or answer_gone) if both_known else None, 0, required=both_known),
        _signal("tools/question ≈ 0 (≤ 0.1)", _rounded(late_tools), no_calls, 2),
        _signal("EM ≈ 0 (≤ 0.02)", _rounded(late_em), None if late_em is None else late_em <= 0.02, 2, True),
        _signal("EM never rose above its first eval (+0.05)", None if rose is None else not rose, None if rose is None else not rose, 0, True),
        _signal("entropy ≤ 0.5 × early", _rounded(entropy_ratio), None if entropy_ratio is None else entropy_ratio <= 0.5),
        _signal("answered share ≤ 0.5", _rounded(answered), answer_gone, 2),  # as strong as "no calls": the other face of the mode
    ]

    cvt, lift = _tail(run.series(EVAL_CVT)), _tail(run.series(EVAL_TOOL_LIFT))
    top_share = facts["top_verb_share"] if facts else _eval_top_verb_share(run)
    out["ritual"] = [
        _signal("tools/question in (0.5, 1.5]", _rounded(late_tools), None if late_tools is None else 0.5 < late_tools <= 1.5, 2, True),
        _signal("EM from memory (≥ 0.05)", _rounded(late_em), None if late_em is None else late_em >= 0.05, 2, True),
        _signal("CvT ≈ 0 (≤ 0.01)", _rounded(cvt), None if cvt is None else cvt <= 0.01, 2),
        _signal("tool lift ≈ 0 (|lift| ≤ 0.02)", _rounded(lift), None if lift is None else abs(lift) <= 0.02),
        _signal("one verb ≥ 90% of calls", _rounded(top_share), None if top_share is None else top_share >= 0.9, 2),
    ]

    drift = _tail(run.series(COLLAPSE_FORMAT_DRIFT))
    if drift is None and facts:
        drift = facts["drift_share"]
    # Without a drift measurement (eval-only histories), its outcome: EM rose, then fell from its
    # peak while calls stopped parsing (tools/question ≈ 0) — a policy that had learned the format.
    vanished = None if drift is not None or rose is None or no_calls is None else bool(rose and _fell_from_peak(em) and no_calls)
    out["format_drift"] = [
        _signal("format drift share ≥ 0.2", _rounded(drift), None if drift is None else drift >= 0.2, 3),
        _signal("EM rose, then fell from its peak as calls vanished", vanished, vanished, 3),
        _signal("drift share ≥ 0.2, or (unmeasured) calls vanished after a peak", None, bool(drift is not None and drift >= 0.2) or bool(vanished), 0, True),
        _signal("entropy ≤ 0.5 × early", _rounded(entropy_ratio), None if entropy_ratio is None else entropy_ratio <= 0.5),
        _signal("samples: tool tags inside <think>", _rounded(facts["drift_share"]) if facts else None, None if not facts else facts["drift_share"] > 0),
    ]

    cliff = _cliff(em)
    context["cliff"] = cliff
    tools_before = tools_after = None
    if cliff:
        # after: where the calls ended (late), not only at the cliff's eval — EM may fall a window before the calls do
        after = [v for v in (_value_near(tools, cliff["step"]), late_tools) if v is not None]
        tools_before, tools_after = _value_near(tools, cliff["previous_step"]), min(after, default=None)
    # "tools/question 3.0 → 1.0": one call per question, not none (calls that stop parsing are drift)
    volume_drop = None if tools_before is None or tools_after is None else (0.5 <= tools_after <= 1.5 and tools_after <= 0.6 * tools_before)
    out["spec_gaming_cliff"] = [
        _signal("EM cliff after a peak within one eval window", cliff, None if not em else cliff is not None, 3, True),
        # The call-volume fall is what tells mode 4 from any other collapse: required wherever
        # tools/question was recorded around the cliff.
        _signal("tools/question drops to ~1 (0.5–1.5) from the cliff on", [tools_before, tools_after] if cliff else None, volume_drop if cliff else None, 2,
                required=volume_drop is not None),
        _signal("entropy not collapsed (≥ 0.5 × early)", _rounded(entropy_ratio), None if entropy_ratio is None else entropy_ratio >= 0.5),
        _signal("samples: quote-and-stop ≥ 50%", _rounded(facts["quote_and_stop_share"]) if facts else None, None if not facts else facts["quote_and_stop_share"] >= 0.5),
    ]

    share = run.series(KL_CONTROL_SHARE)
    late_share, early_share = _tail(share), _tail(share, late=False)
    peak_share = max((v for _, v in share), default=None)
    balance = _tail(run.series(TOKENS_TAG_BALANCE))
    broken = [(s, sum(m.get(k, 0.0) for k in (COLLAPSE_TEXT_POLLUTION, COLLAPSE_FULL) if _is_number(m.get(k))))
              for s, m in ((int(m["step"]), m) for m in run.metrics) if any(_is_number(m.get(k)) for k in (COLLAPSE_TEXT_POLLUTION, COLLAPSE_FULL))]
    broken_rise = None
    if broken:
        broken_rise = _tail(broken) - _tail(broken, late=False)
    elif facts and early_facts:
        broken_rise = facts["broken_share"] - early_facts["broken_share"]
    spike_alerts = sum(1 for a in run.alerts if a.get("kind") == "kl_spike")
    kl_spiked = None if not share else (peak_share >= 0.5 and (early_share is None or peak_share >= 2 * early_share))
    out["control_token_collapse"] = [
        _signal("KL concentrated on control tokens (peak share ≥ 0.5, ≥ 2× early)", _rounded(peak_share), kl_spiked, 3),
        _signal("tag balance broken (≥ 0.1)", _rounded(balance), None if balance is None else balance >= 0.1),
        _signal("pollution + full collapse share rose ≥ 0.2", _rounded(broken_rise), None if broken_rise is None else broken_rise >= 0.2, 2),
        _signal("kl_spike alerts", spike_alerts, spike_alerts > 0 if run.alerts else None),
    ]
    # Paper A's collapse needs the KL concentration or the structural breakdown, at least one,
    # and harm: a KL concentration in a run whose dev EM held or rose is not a collapse (the lr
    # 1e-5 run results/issue12/main-s1-from-sft-lr1e-5-8steps: share 0.5+ while EM went 0.40 → 0.60).
    structure_broke = broken_rise is not None and broken_rise >= 0.2
    last = _last_against_peak(em)
    em_fell = last is not None and last["em"] <= last["peak"] - 0.1
    out["control_token_collapse"].append(_signal("KL concentration or structural breakdown", None, bool(kl_spiked) or structure_broke, 0, True))
    out["control_token_collapse"].append(_signal("harm: dev EM ended ≥ 0.1 below its peak, or the structure broke", None, em_fell or structure_broke, 0, True))
    context["late"] = {"eval/em": _rounded(late_em), "tools/question": _rounded(late_tools), "tokens/entropy": _rounded(late_entropy), "kl/control_share": _rounded(late_share)}
    return out, context


def _eval_top_verb_share(run: RunData) -> float | None:
    if not run.evals:
        return None
    verbs: Counter = Counter()
    for r in run.evals[max(run.evals)]:
        if isinstance(r.get("verbs"), dict):
            verbs.update({str(k): int(v) for k, v in r["verbs"].items() if isinstance(v, (int, float))})
    total = sum(verbs.values())
    return verbs.most_common(1)[0][1] / total if total else None


def _score(signals: list[dict[str, Any]]) -> tuple[float, float, bool]:
    """(score, coverage, qualifies) of one mode's signals."""
    total = sum(s["weight"] for s in signals)
    known = [s for s in signals if s["satisfied"] is not None]
    known_weight = sum(s["weight"] for s in known)
    score = sum(s["weight"] for s in known if s["satisfied"]) / known_weight if known_weight else 0.0
    qualifies = all(s["satisfied"] for s in signals if s["required"])
    return score, (known_weight / total if total else 0.0), qualifies


def _examples(mode: str, run: RunData) -> list[dict[str, Any]]:
    """Up to 3 trajectories of the latest samples that show the mode (any, for the others)."""
    if not run.samples:
        return []
    step = max(run.samples)
    shows = {
        "format_drift": lambda t: any(has_format_drift(x) for x in t.turn_texts),
        "spec_gaming_cliff": is_quote_and_stop,
        "control_token_collapse": _is_broken,
    }.get(mode, lambda t: True)
    chosen = [(i, t) for i, t in enumerate(run.samples[step]) if shows(t)][:3]
    return [{"step": step, "index": i, "task_id": t.task_id, "snippet": _snippet(t)} for i, t in chosen]


def diagnose(run_dir: Path | str) -> dict[str, Any]:
    """Classify a run directory into one of `MODES`; write `run_dir/diagnosis.json` atomically.

    Returns {"mode", "confidence", "evidence": {"signals", "scores", "late", "steps", "warning",
    "examples", "alerts", "read", "bad_lines"}}; "warning" (`_warning`) says whether a
    train-step alert came before the eval that showed the run's last fall, whatever the mode.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"diagnose: run directory {run_dir} does not exist or is not a directory")
    run = RunData(run_dir)
    signals, context = _signals(run)
    scores = {}
    for mode, sig in signals.items():
        score, coverage, qualifies = _score(sig)
        scores[mode] = {"score": round(score, 4), "coverage": round(coverage, 4), "qualifies": qualifies}
    winners = [m for m in PRIORITY if scores[m]["qualifies"]]
    read = {
        "metrics_lines": len(run.metrics),
        "sample_steps": sorted(run.samples),
        "eval_steps": sorted(run.evals),
        "alerts": len(run.alerts),
    }
    fall = None
    if winners:
        mode = max(winners, key=lambda m: (scores[m]["score"], -PRIORITY.index(m)))
        confidence = scores[mode]["score"] * (0.6 + 0.4 * scores[mode]["coverage"])
    else:
        fall = _unnamed_fall(run.series(EVAL_EM))
        mode = "healthy" if fall is None else "unnamed_collapse"
        if fall is not None:
            signals[mode] = [_signal(f"EM fell to ≤ 50% of its peak {fall['peak']:.3g} (step {fall['peak_step']})", _rounded(fall["em"]), True, required=True)]
        # A verdict by absence (no named signature fits) is as strong as what could be looked at.
        looked = [bool(run.series(EVAL_EM)), bool(run.series(TOOLS_PER_QUESTION) or run.series(EVAL_TOOLS_PER_QUESTION)),
                  bool(run.series(TOKENS_ENTROPY)), bool(run.series(KL_CONTROL_SHARE)), bool(run.samples)]
        confidence = 0.0 if not (run.metrics or run.samples or run.evals) else 0.3 + 0.6 * sum(looked) / len(looked)
        if len(run.metrics) < 10:
            confidence *= 0.5  # a handful of steps says little about a trend
    where = context.get("cliff") or fall  # where EM fell: the one-window cliff, else (unnamed) the last eval
    steps = {"peak": where["peak_step"], "collapse": where["step"]} if where else {}
    result = {
        "mode": mode,
        "confidence": round(min(max(confidence, 0.0), 1.0), 4),
        "evidence": {
            "signals": signals.get(mode, []),
            "scores": scores,
            "late": context["late"],
            "steps": steps,
            "warning": _warning(run),
            "examples": _examples(mode, run),
            "alerts": dict(Counter(str(a.get("kind")) for a in run.alerts)),
            "read": read,
            "bad_lines": run.bad_lines,
        },
    }
    atomic_write_text(run_dir / "diagnosis.json", json.dumps(result, indent=2, default=str))
    return result


def format_diagnosis(d: dict[str, Any]) -> str:
    """A few lines for the terminal: the mode, confidence, the signals behind it, examples."""
    ev = d.get("evidence", {})
    lines = [f"mode: {d.get('mode')}  (confidence {d.get('confidence', 0):.2f})"]
    read = ev.get("read", {})
    lines.append(f"read: {read.get('metrics_lines', 0)} metric lines, samples at {read.get('sample_steps', [])}, evals at {read.get('eval_steps', [])}, {read.get('alerts', 0)} alerts")
    late = {k: v for k, v in ev.get("late", {}).items() if v is not None}
    if late:
        lines.append("late values: " + ", ".join(f"{k}={v}" for k, v in late.items()))
    for s in ev.get("signals", []):
        if s["weight"] == 0:
            continue
        mark = {True: "+", False: "-", None: "?"}[s["satisfied"]]
        lines.append(f"  [{mark}] {s['signal']}: {s['value']}")
    if ev.get("steps"):
        lines.append("steps: " + ", ".join(f"{k} {v}" for k, v in ev["steps"].items()))
    w = ev.get("warning")
    if w:
        first = next(iter(w["warnings"]), None)
        said = (f"first train-step alert {first['kind']}" + (f" on {', '.join(first['on'])}" if first.get("on") else "") + f" at step {first['step']}, "
                f"{w['lead_steps']} step(s) before" if first else "no train-step alert before")
        reward = f"training reward fell to half its first value ({w['reward_first']}) at step {w['reward_fell_step']}" if w["reward_fell_step"] is not None else (
            "training reward never fell to half its first value" if w["reward_first"] is not None else "no training reward logged")
        lines.append(f"warning: {said} the eval that showed the fall (step {w['fall_step']}: EM {w['fall'][0]} → {w['fall'][1]}, previous eval step {w['previous_eval_step']}); {reward}")
    for ex in ev.get("examples", []):
        lines.append(f"  e.g. step {ex['step']} #{ex['index']} ({ex['task_id']}): {ex['snippet']}")
    if ev.get("bad_lines"):
        lines.append("skipped unreadable lines: " + ", ".join(f"{k}: {v}" for k, v in ev["bad_lines"].items()))
    return "\n".join(lines)
