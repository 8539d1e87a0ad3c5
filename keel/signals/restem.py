"""Self-distillation, one ReST-EM round (paper B, rung 7): keep a checkpoint's own good episodes, SFT on them.

Paper B takes greedy rollouts of a strong checkpoint over the training questions, keeps those
with EM = 1, at least one successful call and a valid format (50.9% kept), runs SFT from the
base model on them, then GRPO (EM 40.0%, CvT 5.81%). Here: `select` is the filter,
`self_distillation_examples` turns the kept episodes (their own sampled tokens, relabelled as
targets) into SFT examples, `write_trajectories`/`read_trajectories` carry them from the
checkpoint's run to the next run. `keel distill` does the greedy rollouts and the selection;
a run with `signals.self_distill.trajectories` set warm-starts on them (SFT from the base),
then GRPO.

Where Keel departs: on function-calling tasks (no answer string) "EM = 1" is BFCL's checker
verdict and "valid format" is "every call parsed"; "successful call" is a call that parsed,
executed and returned a non-empty result (KG) or no error (function calling). Duplicate
episodes of a question (same token ids) are kept once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Sequence

from keel.diagnostics.episode_metrics import episode_record, is_valid_call
from keel.errors import UserError
from keel.rewards import is_empty_observation
from keel.rundir import iter_jsonl_strict
from keel.sft import SFTExample, decompose
from keel.types import Source, Task, Trajectory, is_function_calling


def why_rejected(traj: Trajectory, task: Task) -> str | None:
    """None when the episode is kept, else the first failed criterion: "not_correct",
    "no_successful_call" or "invalid_format"."""
    if is_function_calling(task):  # function calling: BFCL's verdict
        if traj.info.get("checker_valid") is not True:
            return "not_correct"
        if not any(is_valid_call(s) and s.observation.ok for s in traj.steps):
            return "no_successful_call"
        if not all(s.call.error is None for s in traj.steps):
            return "invalid_format"
        return None
    record = episode_record(traj, task)
    if record["em"] != 1.0:
        return "not_correct"
    if not any(is_valid_call(s) and not is_empty_observation(s.observation.result_text) for s in traj.steps):
        return "no_successful_call"
    if record["format_valid"] != 1.0:
        return "invalid_format"
    return None


def select(trajs: Sequence[Trajectory], tasks: Sequence[Task] | dict[str, Task], max_per_task: int | None = None) -> list[Trajectory]:
    """The episodes ReST-EM keeps: correct, ≥1 successful call, valid format; each distinct
    token sequence once, at most `max_per_task` per question (None: no limit)."""
    by_id = tasks if isinstance(tasks, dict) else {t.id: t for t in tasks}
    kept: list[Trajectory] = []
    seen: set[tuple] = set()
    per_task: Counter = Counter()
    for traj in trajs:
        task = by_id.get(traj.task_id)
        if task is None:
            raise ValueError(f"restem.select: trajectory for task {traj.task_id!r} has no task among the {len(by_id)} given")
        if why_rejected(traj, task) is not None:
            continue
        # token ids when the episode has them; a text-policy episode (no tokens) by its turn texts
        key = tuple(traj.token_ids) if traj.token_ids else ("text", *traj.turn_texts)
        if key in seen or (max_per_task is not None and per_task[traj.task_id] >= max_per_task):
            continue
        seen.add(key)
        per_task[traj.task_id] += 1
        kept.append(traj)
    return kept


def rejection_counts(trajs: Sequence[Trajectory], tasks: Sequence[Task] | dict[str, Task]) -> dict[str, int]:
    """{"kept": n, "not_correct": n, "no_successful_call": n, "invalid_format": n} over the episodes."""
    by_id = tasks if isinstance(tasks, dict) else {t.id: t for t in tasks}
    counts = Counter({"kept": 0, "not_correct": 0, "no_successful_call": 0, "invalid_format": 0})
    for traj in trajs:
        if traj.task_id not in by_id:
            raise ValueError(f"restem.rejection_counts: trajectory for task {traj.task_id!r} has no task among the {len(by_id)} given")
        counts[why_rejected(traj, by_id[traj.task_id]) or "kept"] += 1
    return dict(counts)


def self_distillation_examples(trajs: Sequence[Trajectory], packed: bool = True) -> list[SFTExample]:
    """SFT examples whose targets are each kept episode's own sampled (POLICY) tokens, with any
    hint tokens removed from the context (the distilled policy sees no hints either)."""
    from keel.signals.hints import strip_hints

    out: list[SFTExample] = []
    for traj in trajs:
        if not traj.token_ids or not traj.turn_spans:
            raise ValueError(f"self_distillation_examples: trajectory for task {traj.task_id!r} has no tokens or turns")
        out.extend(decompose(strip_hints(traj), target_sources=(Source.POLICY,), packed=packed))
    return out


def distill(model, tokenizer, env, tasks: Sequence[Task], params, batch_size: int = 25, max_per_task: int | None = None) -> tuple[list[Trajectory], dict[str, int]]:
    """One ReST-EM collection round: greedy rollouts of `model` over `tasks` (keel.evaluate),
    then `select`. Returns (kept episodes, rejection_counts)."""
    from keel.evaluate import evaluate_model

    _means, _rows, trajs = evaluate_model(model, tokenizer, env, tasks, params, batch_size)
    return select(trajs, list(tasks), max_per_task), rejection_counts(trajs, list(tasks))


def write_trajectories(path: str | Path, trajs: Sequence[Trajectory]) -> None:
    """One trajectory per JSON line (Trajectory.to_dict), written atomically."""
    from keel.rundir import write_jsonl

    write_jsonl(Path(path), [t.to_dict() for t in trajs])


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Trajectories written by `write_trajectories`; a missing file or a bad line is a one-line
    error naming the file and line."""
    out = []
    for lineno, row in iter_jsonl_strict(Path(path), "signals.self_distill.trajectories: file"):
        try:
            out.append(Trajectory.from_dict(row))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UserError(f"{path}:{lineno}: not a trajectory ({type(exc).__name__}: {str(exc)[:80]})") from None
    return out
