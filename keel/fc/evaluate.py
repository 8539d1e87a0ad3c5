"""Evaluation of a text policy on BFCL or ACEBench, with paper A's ID / OOD splits.

Paper A reports BFCL-V3 multi-turn and ACEBench, in distribution and out of distribution on two
axes: format (trained on Hermes JSON `<tool_call>`, evaluated on Python-call lists) and content
(whole API classes held out of training). `evaluate_fc` runs every requested call format on the
same tasks and splits tasks by held-out class, and writes `summary.json` + `results.jsonl`.

Aggregates follow the benchmarks' own code:
- BFCL multi-turn overall = unweighted mean of the four categories
  (bfcl_eval.eval_checker.eval_runner_helper.generate_leaderboard_csv, `overall_accuracy_multi_turn`).
- BFCL non-live = unweighted mean of simple, multiple, parallel, parallel_multiple where simple is
  itself the unweighted mean of simple_python / simple_java / simple_javascript; live = mean of the
  four live AST categories weighted by entry count (same function, `overall_accuracy_non_live`,
  `overall_accuracy_live`). A category that was not run counts 0, as in bfcl-eval.
- BFCL-V3 overall = unweighted mean of (live, non-live, multi-turn): `total_overall_accuracy` in
  the V3 releases of the same function (gorilla/berkeley-function-call-leaderboard,
  bfcl/eval_checker/eval_runner_helper.py). The installed V4 code instead weights
  (non-live, live, irrelevance, multi-turn, agentic) by (10, 10, 10, 30, 40); agentic (web search,
  memory) is not run by Keel, so only the V3 formula is reported.
- ACEBench: see `keel.fc.acebench.acebench_overall`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from keel.errors import UserError
from keel.fc.policies import make_oracle, null_policy, run_fc_episode
from keel.types import Task

SIMPLE_PARTS = ("simple_python", "simple_java", "simple_javascript")
NON_LIVE_PARTS = ("simple", "multiple", "parallel", "parallel_multiple")
LIVE_PARTS = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
MULTI_TURN_PARTS = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")


class PolicyFactory:
    """A text policy per call format: `make(call_format) -> text policy` (a model's policy lists
    the tools in the format the evaluation asks for)."""

    def __init__(self, make: Callable[[str], Callable]) -> None:
        self.make = make

    def __call__(self, call_format: str) -> Callable:
        return self.make(call_format)


class ModelPolicy:
    """A local model, greedy, evaluated in batched rollouts (keel.rollout: each episode's cache
    kept across its turns, `batch_size` episodes decoded together) instead of one re-encoded
    conversation per turn. Tasks are batched by the API classes they use, so a batch's prompts
    share their system block (BFCL: ~4.7k tokens of function docs before a ~50-token question),
    which the rollout then encodes once and, on a CPU, keeps once (keel.cascade); results come
    back in task order. Scored as the text policy would be, with two differences kept on
    purpose: the conversation is the token-exact one the model produced (no re-tokenization of
    its turns), and an episode stops at `max_total_tokens` (default the model's context,
    `max_position_embeddings`) where a re-encoding policy would go on past it. A turn cut at
    `max_new_tokens` is closed and parsed like any other (`SamplingParams.on_cut="continue"`)."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 128, batch_size: int = 16, max_total_tokens: int | None = None) -> None:
        if batch_size < 1 or max_new_tokens < 1:
            raise UserError(f"model policy: batch_size and max_new_tokens must be ≥ 1 (got {batch_size}, {max_new_tokens})")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.max_total_tokens = max_total_tokens or int(getattr(model.config, "max_position_embeddings", 0) or 8192)

    def batches(self, env_name: str, tasks: list[Task], call_format: str) -> list[list[int]]:
        """Task indices in batches: one API-class set per batch, ≤ batch_size, tasks with the
        same tools and system prompt next to each other."""
        groups: dict[tuple, list[tuple[str, int]]] = {}
        for i, t in enumerate(tasks):
            env = env_for(env_name, t, call_format)
            prompt = json.dumps(env.tools(t), sort_keys=True) + env.system_prompt(t)
            groups.setdefault((type(env).__name__, tuple(sorted(task_classes(t)))), []).append((prompt, i))
        out = []
        for members in groups.values():
            order = [i for _, i in sorted(members)]
            out += [order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        return out

    def run(self, env_name: str, tasks: list[Task], call_format: str):
        """Yield each batch's [(task index, task, trajectory)], batches as `batches` makes them."""
        import torch

        from keel.rollout import SamplingParams, rollout

        params = SamplingParams(greedy=True, max_new_tokens=self.max_new_tokens, max_total_tokens=self.max_total_tokens, on_cut="continue")
        for batch in self.batches(env_name, tasks, call_format):
            chunk = [tasks[i] for i in batch]
            trajs = rollout(self.model, self.tokenizer, env_for(env_name, chunk[0], call_format), chunk, params,
                            generator=torch.Generator().manual_seed(0), turn_limits=[_max_turns(t) for t in chunk])
            yield list(zip(batch, chunk, trajs))


def resolve_policy(policy: Any, call_format: str) -> Callable:
    """"oracle" / "null" / a text policy / a `PolicyFactory`."""
    if policy == "oracle":
        return make_oracle(call_format)
    if policy == "null":
        return null_policy
    if isinstance(policy, str):
        raise UserError(f"unknown policy {policy!r}: expected 'oracle', 'null' or a callable")
    if isinstance(policy, PolicyFactory):
        return policy(call_format)
    return policy


def bfcl_aggregates(acc: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """BFCL's overall scores from per-category accuracy (fractions) and entry counts.

    Worked example: multi-turn 1.0, 0.5, 0.5, 0.0 -> overall/multi_turn = 2.0 / 4 = 0.5.
    """
    out: dict[str, float] = {}
    if any(c in acc for c in MULTI_TURN_PARTS):
        out["overall/multi_turn"] = sum(acc.get(c, 0.0) for c in MULTI_TURN_PARTS) / 4
    single = [c for c in acc if not c.startswith("multi_turn_")]
    if single:
        simple = sum(acc.get(c, 0.0) for c in SIMPLE_PARTS) / 3
        parts = {"simple": simple, **{c: acc.get(c, 0.0) for c in NON_LIVE_PARTS[1:]}}
        out["overall/non_live"] = sum(parts.values()) / 4
        total = sum(counts.get(c, 0) for c in LIVE_PARTS)
        out["overall/live"] = sum(acc.get(c, 0.0) * counts.get(c, 0) for c in LIVE_PARTS) / total if total else 0.0
        if "irrelevance" in acc or "live_irrelevance" in acc:
            out["overall/irrelevance"] = (acc.get("irrelevance", 0.0) + acc.get("live_irrelevance", 0.0)) / 2
        out["overall/bfcl_v3"] = (out["overall/live"] + out["overall/non_live"] + out.get("overall/multi_turn", 0.0)) / 3
    return out


def _load_bfcl(categories: list[str], limit: int | None) -> list[Task]:
    from keel.fc.bfcl import MULTI_TURN_CATEGORIES, SINGLE_TURN_CATEGORIES, load_bfcl_multi_turn, load_bfcl_single_turn

    tasks: list[Task] = []
    for c in categories:
        short = c.removeprefix("multi_turn_")
        if short in MULTI_TURN_CATEGORIES:
            tasks += load_bfcl_multi_turn(short, limit=limit)
        elif c in SINGLE_TURN_CATEGORIES:
            tasks += load_bfcl_single_turn(c, limit=limit)
        else:
            raise UserError(f"unknown BFCL category {c!r}")
    return tasks


def env_for(env_name: str, task: Task, call_format: str):
    """The Env that runs `task` of benchmark `env_name` ("bfcl", "acebench", "fc_learn") with
    calls written in `call_format`."""
    if env_name == "bfcl":
        from keel.fc.bfcl import BfclEnv, BfclSingleTurnEnv

        return BfclEnv(call_format) if task.kind.startswith("multi_turn_") else BfclSingleTurnEnv(call_format)
    if env_name == "acebench":
        from keel.fc.acebench import AceBenchEnv

        return AceBenchEnv(call_format)
    if env_name == "fc_learn":
        from keel.fc.learnable import LearnableEnv

        return LearnableEnv(call_format)
    raise UserError(f"unknown env {env_name!r}; expected 'bfcl', 'acebench' or 'fc_learn'")


def _max_turns(task: Task) -> int:
    from keel.fc.bfcl import STEP_LIMIT

    if task.kind.startswith("multi_turn_"):
        return len(task.gold_turns) * (STEP_LIMIT + 2)  # BFCL's own limit is the per-turn step limit
    return max(1, len(task.gold_turns)) * 3


def task_classes(task: Task) -> list[str]:
    """The API classes a task uses (BFCL involved_classes; ACEBench / learnable: meta["classes"])."""
    return list(task.meta.get("involved_classes") or task.meta.get("classes") or [])


def evaluate_fc(
    env_name: str,
    policy: Any,
    data: list[Task] | str | None = None,
    categories: list[str] | None = None,
    out_dir: str | Path | None = None,
    call_formats: tuple[str, ...] = ("json",),
    heldout_classes: tuple[str, ...] = (),
    limit: int | None = None,
    recover: tuple[type[BaseException], ...] = (),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `policy` on every task of `env_name` and write out_dir/summary.json + results.jsonl.

    policy: "oracle", "null", a text policy `fn(task, messages) -> str`, a `PolicyFactory`
    (one text policy per call format), or a `ModelPolicy` (a local model in batched rollouts).

    progress: called after every task with a line such as "json 3/20 tasks, 1 valid" (a BFCL
    multi-turn task can take minutes on a CPU).

    recover: exception types (an endpoint's EndpointError) that fail one task, not the whole
    evaluation, once some task has run: the task is scored 0 with its `error`; before any has,
    they are raised (as keel.evaluate.evaluate_text_policy does).

    data: Tasks, or (ACEBench) the directory holding data_<category>.json; None = BFCL's packaged
    data / ACEBench sample. categories: default all four BFCL multi-turn categories / all ACEBench
    normal+special categories present. call_formats: the first is the in-distribution format
    (`accuracy/<category>`); each further one is reported as `format_ood/<fmt>/accuracy/<category>`.
    heldout_classes: tasks touching any of these classes form the content-OOD split, reported as
    `content_ood/accuracy/<category>` next to `content_id/accuracy/<category>`.
    """
    if env_name not in ("bfcl", "acebench", "fc_learn"):
        raise UserError(f"unknown env {env_name!r}; expected 'bfcl', 'acebench' or 'fc_learn'")
    if not call_formats:
        raise UserError("call_formats must name at least one format")
    tasks = _load_tasks(env_name, data, categories, limit)
    rows: list[dict[str, Any]] = []
    ran = 0

    def report(fmt: str, done: list[dict[str, Any]]) -> None:
        if progress is not None:
            progress(f"{fmt} {len(done)}/{len(tasks)} tasks, {sum(r['valid'] for r in done)} valid")

    for fmt in call_formats:
        start = len(rows)  # this format's rows are rows[start:]
        if isinstance(policy, ModelPolicy):
            done: dict[int, dict[str, Any]] = {}
            for batch in policy.run(env_name, tasks, fmt):
                for i, task, tr in batch:
                    ood = bool(set(task_classes(task)) & set(heldout_classes))
                    done[i] = _row(task, fmt, ood, tr.info, len(tr.turn_texts), len(tr.steps), tr.truncated)
                report(fmt, list(done.values()))
            rows += [done[i] for i in sorted(done)]
            continue
        fn = resolve_policy(policy, fmt)
        for i, task in enumerate(tasks):
            if i:
                report(fmt, rows[start:])
            env = env_for(env_name, task, fmt)
            ood = bool(set(task_classes(task)) & set(heldout_classes))
            try:
                episode, info = run_fc_episode(env, task, fn, _max_turns(task))
            except recover as exc:
                if not ran:
                    raise
                rows.append({"id": task.id, "category": task.kind, "call_format": fmt, "content_split": "ood" if ood else "id",
                             "valid": False, "score": 0.0, "error_type": "request_error", "error": str(exc), "assistant_turns": 0,
                             "num_calls": 0, "truncated": False})
                continue
            ran += 1
            rows.append(_row(task, fmt, ood, info, len(episode.turn_texts), len(episode.steps), episode.truncated))
        if tasks:
            report(fmt, rows[start:])
    summary = summarise(env_name, rows, call_formats, bool(heldout_classes))
    if recover:
        from keel.endpoint import request_errors

        summary["request_errors"] = request_errors(rows)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _row(task: Task, fmt: str, ood: bool, info: dict[str, Any], turns: int, calls: int, truncated: bool) -> dict[str, Any]:
    """One line of results.jsonl: the checker's verdict on one task in one call format."""
    return {
        "id": task.id,
        "category": task.kind,
        "call_format": fmt,
        "content_split": "ood" if ood else "id",
        "valid": bool(info.get("checker_valid", False)),
        "score": float(info.get("score", 1.0 if info.get("checker_valid") else 0.0)),
        "error_type": info.get("checker_error_type"),
        "assistant_turns": turns,
        "num_calls": calls,
        "truncated": truncated,
    }


def _load_tasks(env_name: str, data: Any, categories: list[str] | None, limit: int | None) -> list[Task]:
    if isinstance(data, list):
        tasks = data if categories is None else [t for t in data if t.kind in categories]
        return tasks[:limit] if limit is not None else tasks
    if env_name == "bfcl":
        if data is not None:
            raise UserError("bfcl reads bfcl-eval's packaged data; pass Tasks as `data` to use others")
        return _load_bfcl(list(categories or MULTI_TURN_PARTS), limit)
    if env_name == "acebench":
        from keel.fc.acebench import DEFAULT_DATA_DIR, load_acebench

        return load_acebench(data or DEFAULT_DATA_DIR, categories=categories, limit=limit)
    if env_name == "fc_learn":
        from keel.fc.learnable import generate_tasks

        return generate_tasks(limit or 100, seed=0)
    raise UserError(f"unknown env {env_name!r}; expected 'bfcl', 'acebench' or 'fc_learn'")


def _accuracies(rows: list[dict[str, Any]], key: str = "score") -> tuple[dict[str, float], dict[str, int]]:
    acc: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in rows:
        acc[r["category"]] = acc.get(r["category"], 0.0) + r[key]
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    return {c: acc[c] / counts[c] for c in acc}, counts


def _block(env_name: str, rows: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    if env_name == "acebench":
        from keel.fc.acebench import category_accuracies

        acc, counts = category_accuracies(rows)
    else:
        acc, counts = _accuracies(rows)
    out = {f"{prefix}accuracy/{c}": v for c, v in sorted(acc.items())}
    if env_name == "bfcl":
        out.update({prefix + k: v for k, v in bfcl_aggregates(acc, counts).items()})
    elif env_name == "acebench":
        from keel.fc.acebench import acebench_overall

        out.update({prefix + k: v for k, v in acebench_overall(acc, counts).items()})
    return out


def summarise(env_name: str, rows: list[dict[str, Any]], call_formats: tuple[str, ...], content_split: bool) -> dict[str, Any]:
    """summary.json: ID metrics unprefixed, OOD ones prefixed, counts alongside."""
    main_fmt = call_formats[0]
    main = [r for r in rows if r["call_format"] == main_fmt]
    summary: dict[str, Any] = {"env": env_name, "call_format": main_fmt, "num_tasks": len(main)}
    summary.update(_block(env_name, main, ""))
    for fmt in call_formats[1:]:
        summary.update(_block(env_name, [r for r in rows if r["call_format"] == fmt], f"format_ood/{fmt}/"))
    if content_split:
        for split in ("id", "ood"):
            part = [r for r in main if r["content_split"] == split]
            summary[f"content_{split}/num_tasks"] = len(part)
            summary.update(_block(env_name, part, f"content_{split}/"))
    _, counts = _accuracies(main)
    summary["counts"] = counts
    return summary
