"""Evaluate a policy on KG tasks: greedy model rollouts, or a scripted text policy (oracle, null).

Every policy goes through the same turn processing (keel.episode), parser and scorer, so the
oracle checks loader + environment + scorer together, and a model is scored exactly as the
oracle is. Per-question rows go to `eval/step_NNNNNN.jsonl`; means use keel.metrics names.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from keel import metrics as M
from keel.answers import exact_match, f1_score, normalise
from keel.chat import has_answer_tag
from keel.episode import run_text_episode
from keel.rollout import SamplingParams, rollout
from keel.types import Env, Step, Task, Trajectory


def episode_row(task: Task, answer: str | None, steps: list[Step], turn_texts: list[str], finished: bool) -> dict[str, Any]:
    """Per-question result. format_valid: answered inside <answer> tags and every call parsed."""
    golds = list(task.answers) + list(task.aliases)
    em = exact_match(answer, golds)
    f1 = f1_score(answer, task.answers[0]) if task.answers else 0.0
    answered = finished and bool(turn_texts) and has_answer_tag(turn_texts[-1])
    calls_ok = all(s.call.error is None for s in steps)
    norm_answer = normalise(answer or "")
    in_tool = bool(norm_answer) and any(norm_answer in normalise(s.observation.text) for s in steps if s.observation.ok)
    return {
        "task_id": task.id,
        "answer": answer,
        "gold": task.answers[0] if task.answers else None,
        "em": em,
        "f1": f1,
        "answered": float(answered),
        "format_valid": float(answered and calls_ok),
        "tools": len(steps),
        "tool_errors": sum(1 for s in steps if not s.observation.ok),
        "cvt": float(em == 1.0 and in_tool),
        "turns": len(turn_texts),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, float]:
    n = max(len(rows), 1)

    def mean(k: str) -> float:
        return sum(float(r[k]) for r in rows) / n

    return {
        M.EVAL_EM: mean("em"),
        M.EVAL_F1: mean("f1"),
        M.EVAL_FORMAT_VALID: mean("format_valid"),
        M.EVAL_ANSWERED: mean("answered"),
        M.EVAL_TOOLS_PER_QUESTION: mean("tools"),
        M.EVAL_CVT: mean("cvt"),
        M.EVAL_N: float(len(rows)),
    }


def evaluate_model(
    model,
    tokenizer,
    env: Env,
    tasks: Sequence[Task],
    params: SamplingParams,
    batch_size: int = 25,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]], list[Trajectory]]:
    """Greedy rollouts in batches → (means, per-question rows, trajectories)."""
    params = SamplingParams(**{**params.__dict__, "greedy": True})
    rows, trajs = [], []
    for s in range(0, len(tasks), batch_size):
        chunk = list(tasks[s : s + batch_size])
        out = rollout(model, tokenizer, env, chunk, params, generator=torch.Generator().manual_seed(0))
        for task, tr in zip(chunk, out):
            rows.append(episode_row(task, tr.answer, tr.steps, tr.turn_texts, tr.finished))
            trajs.append(tr)
        if progress:
            progress(len(chunk))
    return summarise(rows), rows, trajs


def evaluate_text_policy(env: Env, tasks: Sequence[Task], policy, max_turns: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """A scripted policy (oracle, null, endpoint) through the same loop and scorer."""
    rows = []
    for task in tasks:
        ep = run_text_episode(env, task, policy, max_turns)
        rows.append(episode_row(task, ep.answer, ep.steps, ep.turn_texts, ep.finished))
    return summarise(rows), rows
