"""Per-episode outcome and tool-use metrics, their batch means, pass@k and tool lift (paper B).

Paper B judges a run by EM, tools/question, CvT (correct *via* a tool: the answer is right and
appears in some tool output) and tool lift (pass@k with tools − pass@k with tools disabled);
a ritual shows tools/question > 0 with CvT ≈ 0 and lift ≈ 0. Keel departs in reading
"appears verbatim" as a whole-word match of the normalised answer inside the normalised
observation text, so that "paris" does not count as found in "parisian". Every fact here
reads the tool's own output (`Observation.result_text`, without an oracle hint) and counts
distinct calls as the env executed them (`keel.rewards.call_key`), as the rewards do.
"""

from __future__ import annotations

import math
from collections import Counter
from math import comb
from typing import Any

from keel.answers import normalise
from keel.chat import has_answer_tag
from keel.metrics import (
    EVAL_ANSWERED,
    EVAL_CVT,
    EVAL_EM,
    EVAL_F1,
    EVAL_FORMAT_VALID,
    EVAL_N,
    EVAL_TOOLS_PER_QUESTION,
    TOOLS_DISTINCT_NONEMPTY,
    TOOLS_EMPTY_RESULTS,
    TOOLS_FAILURE_FREQUENCY,
    TOOLS_ERRORS_PREFIX,
    TOOLS_PER_QUESTION,
    TOOLS_VALID_CALLS,
)
from keel.rewards import distinct_nonempty_calls, is_empty_observation, outcome
from keel.types import Step, Task, Trajectory

# Errors that mean the call was never executed against the tool: parse failures
# (keel.chat.parse_tool_calls) and dispatch failures. `unknown_entity` / `no_result` are
# executed queries that found nothing (paper B's silent failure), so they count as valid calls.
NOT_EXECUTED_ERRORS = frozenset({"bad_json", "bad_call", "too_long", "unclosed_tag", "unknown_tool", "bad_arguments", "env_exception"})


def is_valid_call(step: Step) -> bool:
    """The call parsed and was executed (its result may still be empty)."""
    return step.call.error is None and step.observation.error not in NOT_EXECUTED_ERRORS


def answer_in_tool_output(answer: str | None, steps: list[Step]) -> bool:
    """The normalised answer occurs, on word boundaries, in some non-empty observation."""
    a = normalise(answer or "")
    if not a:
        return False
    return any(f" {a} " in f" {normalise(s.observation.result_text)} " for s in steps if not is_empty_observation(s.observation.result_text))


def episode_record(traj: Trajectory, task: Task) -> dict[str, Any]:
    """One line of `eval/step_XXXXXX.jsonl`: outcome, format and tool-use facts of one episode.

    answered: the last turn has an `<answer>…</answer>`; format_valid: answered and every call
    parsed; cvt: EM 1 and `answer_in_tool_output`; verbs: calls per verb; errors: count per
    error kind (the call's parse error, else the observation's error).
    """
    out = outcome(traj, task)
    last = traj.turn_texts[-1] if traj.turn_texts else ""
    answered = traj.answer is not None and has_answer_tag(last)
    parsed = all(s.call.error is None for s in traj.steps)
    errors = Counter(s.call.error or s.observation.error for s in traj.steps if (s.call.error or s.observation.error))
    return {
        "task_id": traj.task_id,
        "answer": traj.answer,
        "em": out["em"],
        "f1": out["f1"],
        "answered": float(answered),
        "format_valid": float(answered and parsed),
        "cvt": float(out["em"] == 1.0 and answer_in_tool_output(traj.answer, traj.steps)),
        "tools": len(traj.steps),
        "valid_calls": sum(is_valid_call(s) for s in traj.steps),
        "empty_results": sum(is_empty_observation(s.observation.result_text) for s in traj.steps),
        "failed_calls": sum(not s.observation.ok for s in traj.steps),
        "distinct_nonempty": distinct_nonempty_calls(traj.steps),
        "verbs": dict(Counter(s.call.name or "<unparsed>" for s in traj.steps)),
        "errors": dict(errors),
        "finished": traj.finished,
        "truncated": traj.truncated,
    }


def _mean(records: list[dict[str, Any]], key: str) -> float:
    """Mean over the records whose `key` is a finite number (older or hand-made eval files may
    lack fields or hold garbage); NaN if none."""
    values = [float(v) for v in (r.get(key) for r in records)
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def eval_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """Means of episode records under the `eval/...` names; {} for no records."""
    if not records:
        return {}
    out = {
        EVAL_EM: _mean(records, "em"),
        EVAL_F1: _mean(records, "f1"),
        EVAL_FORMAT_VALID: _mean(records, "format_valid"),
        EVAL_ANSWERED: _mean(records, "answered"),
        EVAL_TOOLS_PER_QUESTION: _mean(records, "tools"),
        EVAL_CVT: _mean(records, "cvt"),
        EVAL_N: float(len(records)),
    }
    return {key: v for key, v in out.items() if v == v}  # a field no record has is left out, not NaN


def tool_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """Tool-use metrics of a rollout batch under the `tools/...` names.

    Call shares are pooled over all calls of the batch and left out when there were no calls
    (a batch without calls has no valid-call share, rather than a share of 0 that would read as
    "every call failed"). `tools/error/<kind>` is the count of that error in the batch.
    """
    if not records:
        return {}
    calls = sum(r["tools"] for r in records)
    out = {TOOLS_PER_QUESTION: calls / len(records), TOOLS_DISTINCT_NONEMPTY: _mean(records, "distinct_nonempty")}
    if calls:
        out[TOOLS_VALID_CALLS] = sum(r["valid_calls"] for r in records) / calls
        out[TOOLS_EMPTY_RESULTS] = sum(r["empty_results"] for r in records) / calls
    errors: Counter = Counter()
    for r in records:
        errors.update(r["errors"])
    for kind, n in sorted(errors.items()):
        out[TOOLS_ERRORS_PREFIX + str(kind)] = float(n)
    return out


def failure_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """`tools/failure_frequency`: failed calls (the answer was a refusal, an exception or a
    timeout: `Observation.ok` False) over all calls of the batch; {} without calls, or when a
    record predates the `failed_calls` field.

    Worked example: records with (tools, failed_calls) (2, 1), (3, 0), (0, 0) → 1 / 5 = 0.2.
    """
    calls = sum(r["tools"] for r in records)
    if not calls or not all("failed_calls" in r for r in records):
        return {}
    return {TOOLS_FAILURE_FREQUENCY: sum(r["failed_calls"] for r in records) / calls}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 − C(n−c, k) / C(n, k).

    Worked example: n 4, c 1, k 2 → 1 − C(3, 2)/C(4, 2) = 1 − 3/6 = 0.5.
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise ValueError(f"pass_at_k: n, c, k must be integers, got n={n!r} c={c!r} k={k!r}")
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def correct_counts(records: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """{task_id: (samples, EM-correct samples)} from per-sample episode records."""
    counts: dict[str, list[int]] = {}
    for r in records:
        nc = counts.setdefault(str(r["task_id"]), [0, 0])
        nc[0] += 1
        nc[1] += int(float(r["em"]) == 1.0)
    return {t: (n, c) for t, (n, c) in counts.items()}


def mean_pass_at_k(counts: dict[str, tuple[int, int]], k: int) -> float:
    """Mean pass@k over questions; counts as from `correct_counts`."""
    if not counts:
        raise ValueError("mean_pass_at_k: no questions")
    return sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts)


def tool_lift(with_tools: dict[str, tuple[int, int]], without_tools: dict[str, tuple[int, int]], k: int) -> float:
    """pass@k with tools − pass@k with tools disabled, over the same questions."""
    if with_tools.keys() != without_tools.keys():
        missing = sorted(with_tools.keys() ^ without_tools.keys())
        raise ValueError(f"tool_lift: the two runs cover different questions, e.g. {missing[:3]} ({len(missing)} differ)")
    return mean_pass_at_k(with_tools, k) - mean_pass_at_k(without_tools, k)
