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
from keel.templates import ChatTemplate
from keel.types import Env, Task, Trajectory


def question_hash(task: Task) -> str:
    """16 hex digits of the question and its gold answers: two eval files agree on a question
    id only if they agree on this."""
    import hashlib

    text = "\x1f".join([task.question, *map(str, task.answers or [])])
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]


def _record(tr: Trajectory, task: Task) -> dict[str, Any]:
    """episode_record, plus: for function-calling tasks (no answer string; the BFCL checker
    judges the whole conversation) `em` is the checker's verdict, so eval/em reads as exact
    success in both task families."""
    row = episode_record(tr, task)
    row["question_hash"] = question_hash(task)  # `keel compare` refuses runs whose same ids are different questions
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
    chat: ChatTemplate | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]], list[Trajectory]]:
    """Greedy rollouts in batches → (means, per-question rows, trajectories); `chat`: rendered
    with the model's own template (keel.templates), as in training."""
    params = SamplingParams(**{**params.__dict__, "greedy": True})
    rows, trajs = [], []
    for s in range(0, len(tasks), batch_size):
        chunk = list(tasks[s : s + batch_size])
        out = rollout(model, tokenizer, env, chunk, params, generator=torch.Generator().manual_seed(0), chat=chat)
        for task, tr in zip(chunk, out):
            rows.append(_record(tr, task))
            trajs.append(tr)
        if progress:
            progress(len(chunk))
    return eval_metrics(rows), rows, trajs


def evaluate_text_policy(env: Env, tasks: Sequence[Task], policy, max_turns: int, recover: tuple[type[BaseException], ...] = (),
                         warn: Callable[[str], None] | None = None) -> tuple[dict[str, float], list[dict[str, Any]], list[Trajectory]]:
    """A scripted policy (oracle, null, endpoint) through the same loop and scorer.

    `recover`: exception types (an endpoint's EndpointError) that fail one question, not the
    evaluation: once some question has been answered, such a failure is recorded as that
    question's `error` (scored 0, an empty episode) and the evaluation goes on; before any has,
    it is raised (a server that never answers is a configuration error, not a result).
    """
    rows, trajs = [], []
    answered = 0
    for task in tasks:
        try:
            tr = run_text_episode(env, task, policy, max_turns).to_trajectory()
        except recover as exc:
            if not answered:
                raise
            tr = Trajectory(task_id=task.id, token_ids=[], sources=[], logprobs=[], info={"error": str(exc)})
            if warn:
                warn(f"question {task.id}: {exc} (recorded as its error; the evaluation goes on)")
        else:
            answered += 1
        row = _record(tr, task)
        if "error" in tr.info:
            row["error"] = tr.info["error"]
        rows.append(row)
        trajs.append(tr)
    return eval_metrics(rows), rows, trajs


def gold_replay_policy(task: Task, messages: list[dict[str, Any]]) -> str:
    """The oracle of a task with a gold trajectory (`gold_turns` + answer): at the k-th assistant
    turn, the k-th gold text (`keel.sft.gold_turn_texts`: the turn's calls as `<tool_call>`
    blocks, finally `<answer>…</answer>`). Its calls are parsed and executed like a model's."""
    from keel.sft import gold_turn_texts

    texts = gold_turn_texts(task)
    k = sum(1 for m in messages if m["role"] == "assistant")
    return texts[min(k, len(texts) - 1)]


def model_text_policy(model, tokenizer, tools_for: Callable[[Task], list], max_new_tokens: int = 256):
    """A greedy model as a text policy `fn(task, messages) -> str`: the whole conversation
    re-rendered and re-encoded at every turn, one episode at a time. `keel eval` runs models in
    batched rollouts instead (keel.fc.evaluate.ModelPolicy, ~6.5× faster on BFCL); this stays
    the reference a text-policy evaluator can wrap any model in, and the tests' yardstick."""
    from keel.chat import IM_END, render_conversation

    eos = tokenizer.convert_tokens_to_ids(IM_END)

    @torch.no_grad()
    def policy(task: Task, messages: list[dict[str, Any]]) -> str:
        ids = tokenizer.encode(render_conversation(messages, tools_for(task)), add_special_tokens=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
        new = out[0, len(ids):].tolist()
        if new and new[-1] == eos:
            new = new[:-1]
        return tokenizer.decode(new, skip_special_tokens=False)

    return policy


class ToolsDisabled:
    """The same environment with its tools taken away (paper B's tool-lift control): no schemas
    in the prompt, and any call the model still makes answers with an error."""

    def __init__(self, env: Env):
        self.env = env
        self.name = f"{env.name}-no-tools"

    def tools(self, task: Task) -> list:
        return []

    def system_prompt(self, task: Task) -> str:
        return self.env.system_prompt(task) + "\nNo tools are available: answer from what you know."

    def user_message(self, task: Task) -> str:
        return self.env.user_message(task)

    def start(self, task: Task):
        return _NoToolEpisode()


class _NoToolEpisode:
    def execute(self, call):
        from keel.types import Observation

        return Observation(text="ERROR: no tools are available", ok=False, error="tools_disabled")

    def next_user_message(self):
        return None

    def close(self):
        pass


def tool_lift_metrics(model, tokenizer, env: Env, tasks: Sequence[Task], params: SamplingParams, k: int,
                      generator: torch.Generator, batch_size: int = 32, chat: ChatTemplate | None = None) -> dict[str, float]:
    """pass@k with tools, pass@k with tools disabled and their difference (paper B's tool lift),
    from k sampled episodes per question in each condition (unbiased pass@k with n = k);
    `chat` as in evaluate_model."""
    from keel import metrics as M
    from keel.diagnostics.episode_metrics import correct_counts, mean_pass_at_k, tool_lift

    sampled = SamplingParams(**{**params.__dict__, "greedy": False})
    counts = {}
    for label, e in (("with", env), ("without", ToolsDisabled(env))):
        rows = [t for t in tasks for _ in range(k)]
        records = []
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            for task, tr in zip(chunk, rollout(model, tokenizer, e, chunk, sampled, generator=generator, chat=chat)):
                records.append(_record(tr, task))
        counts[label] = correct_counts(records)
    return {
        M.EVAL_PASS_AT_K_TOOLS: mean_pass_at_k(counts["with"], k),
        M.EVAL_PASS_AT_K_NO_TOOLS: mean_pass_at_k(counts["without"], k),
        M.EVAL_TOOL_LIFT: tool_lift(counts["with"], counts["without"], k),
    }
