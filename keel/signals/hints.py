"""Hint-based guidance (paper A): a hint is shown while sampling and cut out before the update.

Paper A adds hints (their code: 2 hints, in the system message) to the prompt only when
sampling; the optimisation step sees the prompt without them, so the policy cannot come to
depend on them. In Keel the hint tokens carry `Source.HINT`; `keel.logprobs.collate` drops
them, so every trained sequence is the hint-free one (tests/test_signals_hints.py checks the
loss log-probs equal a hint-free forward to 1e-5).

Where Keel departs:
- hint content is ours (their hint texts are not public): the gold first call, the gold
  relation path (KG) or the functions the gold uses (function calling);
- `HintPolicy(only_failed=True)` hints a prompt only when its whole group failed the last time
  it was sampled, a curriculum paper A does not describe (it is off by default);
- the importance ratio: Keel's stored "old" log-probs of a hinted row are the sampling ones
  (conditioned on the hint), while verl recomputes old log-probs on the training sequence
  (hint-free), giving ratio 1 at the step. `signals.hint.recompute_old_logprobs` gives the
  authors' behaviour: hinted rows' old log-probs are taken from the policy before the update
  on the hint-free sequence (`SignalState.old_from_policy`).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Sequence

from keel import metrics as M
from keel.config import SignalsConfig
from keel.rollout import HINT_POSITIONS, encode_prompt
from keel.signals.base import Signal, SignalContext
from keel.types import Env, Source, Task, Trajectory, env_call_format



# --- hint texts -----------------------------------------------------------------------------------


def first_call_hint(task: Task, env: Env | None = None) -> str | None:
    """The gold first call, in the env's call format; None when the gold has no call.

    >>> t = Task(id="t", question="q", answers=["a"], gold_turns=[[{"name": "f", "arguments": {"x": 1}}]])
    >>> first_call_hint(t)
    'Hint: a good first call is {"name": "f", "arguments": {"x": 1}}'
    """
    for turn in task.gold_turns:
        if turn:
            call = turn[0]
            fmt = env_call_format(env)
            if fmt == "json":
                shown = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
            else:
                from keel.fc.parse import canonical_call

                shown = canonical_call(call["name"], call["arguments"])
            return f"Hint: a good first call is {shown}"
    return None


def relation_path_hint(task: Task, env: Env | None = None) -> str | None:
    """KG: the relations of the gold path in order (from `gold_triples`, else from the gold
    calls' `relation` arguments); None without either.

    >>> t = Task(id="t", question="q", answers=["a"], gold_triples=[("m.1", "film.directed_by", "m.2"), ("m.2", "person.born_in", "m.3")])
    >>> relation_path_hint(t)
    'Hint: the answer is reached through the relations film.directed_by -> person.born_in'
    """
    relations = [r for _h, r, _t in task.gold_triples]
    if not relations:
        relations = [c["arguments"]["relation"] for turn in task.gold_turns for c in turn
                     if isinstance(c.get("arguments"), dict) and isinstance(c["arguments"].get("relation"), str)]
    if not relations:
        return None
    return "Hint: the answer is reached through the relations " + " -> ".join(relations)


def function_names_hint(task: Task, env: Env | None = None) -> str | None:
    """Function calling: the distinct functions the gold calls, in first-use order; None if none."""
    names: list[str] = []
    for turn in task.gold_turns:
        for c in turn:
            if c.get("name") and c["name"] not in names:
                names.append(c["name"])
    return ("Hint: the functions needed are " + ", ".join(names)) if names else None


HINTS: dict[str, Callable[[Task, Env | None], str | None]] = {
    "first_call": first_call_hint,
    "relation_path": relation_path_hint,
    "function_names": function_names_hint,
}


def build_hint(task: Task, env: Env | None, kinds: Sequence[str]) -> str | None:
    """The hints of `kinds` that apply to this task, one per line; None when none applies."""
    unknown = [k for k in kinds if k not in HINTS]
    if unknown:
        raise ValueError(f"signals.hint.kinds: unknown hint kind(s) {unknown} (known: {', '.join(HINTS)})")
    parts = [h for k in kinds if (h := HINTS[k](task, env))]
    return "\n".join(parts) if parts else None


# --- prompts and trajectories -----------------------------------------------------------------------


def encode_prompt_with_hint(tokenizer, env: Env, task: Task, hint: str | None, position: str = "system") -> tuple[list[int], list[int]]:
    """(ids, sources) of the prompt with the hint at `position` ("system" or "user"), hint tokens
    sourced HINT; `keel.rollout.encode_prompt` does the work (one layout for every caller)."""
    return encode_prompt(tokenizer, env, task, hint, position)


def strip_hints(traj: Trajectory) -> Trajectory:
    """A copy of the trajectory without its HINT tokens; turn spans shifted to match.

    Worked example: sources [0 0 3 3 0 | 1 1] with turn_spans [(5, 7)] → sources [0 0 0 | 1 1],
    turn_spans [(3, 5)]. This is the sequence `collate` trains on.
    """
    keep = [i for i, s in enumerate(traj.sources) if s != Source.HINT]
    if len(keep) == len(traj.sources):
        return copy.deepcopy(traj)
    removed_before = [0] * (len(traj.sources) + 1)
    for i, s in enumerate(traj.sources):
        removed_before[i + 1] = removed_before[i] + (s == Source.HINT)
    out = copy.deepcopy(traj)
    out.token_ids = [traj.token_ids[i] for i in keep]
    out.sources = [traj.sources[i] for i in keep]
    out.logprobs = [traj.logprobs[i] for i in keep]
    out.turn_spans = [(a - removed_before[a], b - removed_before[b]) for a, b in traj.turn_spans]
    return out


def is_hinted(traj: Trajectory) -> bool:
    return any(s == Source.HINT for s in traj.sources)


# --- which prompts get a hint -----------------------------------------------------------------------


class HintPolicy:
    """Decides the hint of each prompt: `hints_for(tasks)` before sampling, `observe(...)` after.

    only_failed=False: every prompt with a gold trajectory gets its hint (paper A).
    only_failed=True: a prompt gets its hint only if its whole group scored ≤ `fail_at` the last
    time it was sampled; a later group that succeeds (with or without the hint) clears it.
    """

    def __init__(self, env: Env | None, kinds: Sequence[str] = ("first_call", "relation_path"), position: str = "system",
                 only_failed: bool = False, fail_at: float = 0.0) -> None:
        if position not in HINT_POSITIONS:
            raise ValueError(f"signals.hint.position: {position!r} is not one of {HINT_POSITIONS}")
        build_hint(Task(id="", question="", answers=[]), env, kinds)  # unknown kinds fail here
        self.env = env
        self.kinds = tuple(kinds)
        self.position = position
        self.only_failed = only_failed
        self.fail_at = float(fail_at)
        self.failed: set[str] = set()

    def hints_for(self, tasks: Sequence[Task]) -> list[str | None]:
        """One hint (or None) per task, in order; rows of the same task get the same hint."""
        return [build_hint(t, self.env, self.kinds) if (not self.only_failed or t.id in self.failed) else None for t in tasks]

    def observe(self, task_ids: Sequence[str], group_rewards: Sequence[Sequence[float]]) -> None:
        """Record each prompt's group outcome (the rewards of its on-policy members)."""
        if len(task_ids) != len(group_rewards):
            raise ValueError(f"HintPolicy.observe: {len(task_ids)} task ids but {len(group_rewards)} groups of rewards")
        for tid, rewards in zip(task_ids, group_rewards):
            if not len(rewards):
                raise ValueError(f"HintPolicy.observe: task {tid!r} has an empty group")
            if max(float(r) for r in rewards) <= self.fail_at:
                self.failed.add(tid)
            else:
                self.failed.discard(tid)

    def state_dict(self) -> dict[str, Any]:
        return {"failed": sorted(self.failed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        failed = state.get("failed") if isinstance(state, dict) else None
        if not isinstance(failed, list) or not all(isinstance(t, str) for t in failed):
            raise ValueError("HintPolicy.load_state_dict: expected {'failed': [task ids]}")
        self.failed = set(failed)


class Hints(Signal):
    """`signals.hint`: a hint in each chosen prompt while sampling (HintPolicy decides which);
    collate drops the hint tokens, and under `recompute_old_logprobs` a hinted row takes its old
    log-probs from the policy on the hint-free sequence (π(·|no hint), as verl's recomputed
    old log-probs give) since it was sampled with the hint in context."""

    name = "hints"

    def __init__(self, cfg: SignalsConfig, ctx: SignalContext):
        super().__init__(cfg, ctx)
        h = cfg.hint
        self.policy = HintPolicy(ctx.env, h.kinds, h.position, h.only_failed, h.fail_at)

    @staticmethod
    def enabled(cfg: SignalsConfig) -> bool:
        return cfg.hint.enabled

    def hints(self, batch_tasks):
        per_task = self.policy.hints_for(batch_tasks)
        return per_task, {M.SIGNAL_HINTED_GROUPS: sum(h is not None for h in per_task) / len(per_task)}

    def observe(self, rl_step, task_ids, group_rewards):
        self.policy.observe(task_ids, group_rewards)
        return {}

    def old_from_policy(self, traj: Trajectory) -> bool:
        return self.cfg.hint.recompute_old_logprobs and is_hinted(traj)

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)
