"""Evaluate a policy on KG tasks: greedy model rollouts, or a scripted text policy (oracle, null).

Every policy goes through the same turn processing (keel.episode), parser and scorer, so the
oracle checks loader + environment + scorer together, and a model is scored exactly as the
oracle is. Per-question rows (keel.diagnostics.episode_metrics.episode_record) go to
`eval/step_NNNNNN.jsonl`; means use keel.metrics names.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from keel.diagnostics.episode_metrics import episode_record, eval_metrics
from keel.episode import run_text_episode
from keel.rollout import SamplingParams, rollout
from keel.types import Env, Task, Trajectory


def _record(tr: Trajectory, task: Task) -> dict[str, Any]:
    """episode_record, plus: for function-calling tasks (no answer string; the BFCL checker
    judges the whole conversation) `em` is the checker's verdict, so eval/em reads as exact
    success in both task families."""
    row = episode_record(tr, task)
    if "checker_valid" in tr.info:
        row["checker_valid"] = bool(tr.info["checker_valid"])
        row["em"] = float(row["checker_valid"])
    return row


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
            rows.append(_record(tr, task))
            trajs.append(tr)
        if progress:
            progress(len(chunk))
    return eval_metrics(rows), rows, trajs


def evaluate_text_policy(env: Env, tasks: Sequence[Task], policy, max_turns: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """A scripted policy (oracle, null, endpoint) through the same loop and scorer."""
    rows = []
    for task in tasks:
        ep = run_text_episode(env, task, policy, max_turns)
        rows.append(_record(ep.to_trajectory(), task))
    return eval_metrics(rows), rows
