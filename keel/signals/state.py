"""The supervision signals of one run in one object: what they are set to, and what they remember.

What a signal remembers between RL steps, and so what a checkpoint must keep:
- the hint policy: which prompts' groups last failed (`signals.hint.only_failed`)
- the ETS buffer: recently all-failed prompts and the step of their failure
- the reflection pool (PRS): the newest `signals.reflection.pool` reflection examples
`state_dict()` holds all three; `load_state_dict` restores them. The gold-trajectory cache is not
state: gold trajectories are deterministic, rebuilt on demand after a resume.

keel.train.rl_step asks the signals, in this order: `hints` (before sampling), `observe` (after
the rewards), `reflect` (PRS), `sync_losses` (the synchronous paradigm's extra losses) and
`old_from_policy` (which rows' old log-probs the update takes from the policy); OPS changes
the groups themselves: `replaced_slots` (before sampling) and `members` (the rows the update
trains on, with their advantages).
"""

from __future__ import annotations

from typing import Any

from keel import metrics as M
from keel.config import GRPOConfig, SignalsConfig
from keel.distributed import DistContext, advantages, all_reduce_sum
from keel.sft import SFTExample, cached_gold_trajectory, decompose
from keel.signals.ets import ETSBuffer
from keel.signals.hints import HintPolicy
from keel.signals.ops import expert_members, group_with_experts
from keel.signals.reflection import LLMAnalyzer, RuleAnalyzer
from keel.signals.schedule import Schedule
from keel.types import Env, Source, Task, Trajectory, env_call_format


class SignalState:
    """The signals' objects (None when a signal is off) and the mutable state they share."""

    def __init__(self, signals: SignalsConfig, rl_lr: float, env: Env, tokenizer, train_tasks: list[Task], tasks_by_id: dict[str, Task],
                 packed: bool):
        s = self.cfg = signals
        self.tokenizer, self.env, self.train_tasks, self.tasks_by_id, self.packed = tokenizer, env, train_tasks, tasks_by_id, packed
        self.schedule = Schedule.from_config(s, rl_lr)
        self.hint_policy = HintPolicy(env, s.hint.kinds, s.hint.position, s.hint.only_failed, s.hint.fail_at) if s.hint.enabled else None
        self.ets = ETSBuffer(s.ets.window, s.ets.capacity, s.ets.fail_at) if s.ets.enabled else None
        self.analyzer = None
        if s.reflection.enabled:
            self.analyzer = RuleAnalyzer(env) if s.reflection.analyzer == "rule" else LLMAnalyzer(
                s.reflection.base_url, s.reflection.model, s.reflection.api_key or None, env_call_format(env))
        self.reflections: list[SFTExample] = []  # newest last, at most signals.reflection.pool
        self.gold_cache: dict[str, Trajectory] = {}  # the run's gold trajectories (SFT pool, ETS, OPS), built once per task
        self._gold_examples: list[SFTExample] | None = None

    def supervision_pool(self, kind: str) -> list[SFTExample]:
        """The examples a supervision kind trains on now: gold SFT of all training tasks, the
        ETS buffer's gold trajectories, or the reflection pool."""
        if kind == "sft":
            if self._gold_examples is None:
                golds = [cached_gold_trajectory(self.tokenizer, self.env, t, self.gold_cache) for t in self.train_tasks]
                self._gold_examples = [e for g in golds if g.info.get("gold_ok", True) for e in decompose(g, packed=self.packed)]
            return self._gold_examples
        if kind == "ets":
            return self.ets.sft_examples(self.tokenizer, self.env, self.tasks_by_id, packed=self.packed, cache=self.gold_cache)
        return list(self.reflections)

    # --- what an RL step asks of the signals, in the order it asks -------------------------------------
    def hints(self, batch_tasks: list[Task], groups: list[int]) -> tuple[list[str | None] | None, dict[str, float]]:
        """Before sampling: each row's hint (a group's rows share their task's; None: no hint
        policy), and signal/hinted_groups. Hints are shown while sampling only; collate drops them."""
        if self.hint_policy is None:
            return None, {}
        per_task = self.hint_policy.hints_for(batch_tasks)
        return [per_task[k] for k in groups], {M.SIGNAL_HINTED_GROUPS: sum(h is not None for h in per_task) / len(per_task)}

    def observe(self, rl_step: int, task_ids: list[str], group_rewards: list[list[float]]) -> dict[str, float]:
        """After the rewards: the hint policy and the ETS buffer see each group's outcome (its
        sampled members); queries whose whole group failed enter the ETS buffer. Returns signal/ets_buffer."""
        if self.hint_policy is not None:
            self.hint_policy.observe(task_ids, group_rewards)
        if self.ets is None:
            return {}
        self.ets.observe(rl_step, task_ids, group_rewards)
        return {M.SIGNAL_ETS_BUFFER: float(len(self.ets))}

    def replaced_slots(self) -> int:
        """Before sampling: the group slots gold members take from sampled rows (OPS "replace",
        the authors' replace_num=1); 0 otherwise."""
        ops = self.cfg.ops
        return ops.members if ops.enabled and ops.mode == "replace" else 0

    def members(self, local: list[Trajectory], rewards, groups: list[int], batch_tasks: list[Task], mine: list[int], reward_fn,
                grpo: GRPOConfig, ctx: DistContext) -> tuple[list[Trajectory], Any, dict[str, float]]:
        """After the rewards: (the trajectories this rank's update trains on, their advantages,
        signal/ops_members). Without OPS the sampled rows with GRPO's advantages
        (`keel.distributed.advantages`); with OPS each of this rank's groups (`mine`) gains its
        gold members and advantages are taken over both kinds (Eq. 4)."""
        if not self.cfg.ops.enabled:
            return local, advantages(rewards, groups, grpo, ctx), {}
        experts = [e for k in mine for e in expert_members(self.tokenizer, self.env, batch_tasks[k], self.cfg.ops.members, group=k, cache=self.gold_cache)]
        expert_rewards = [reward_fn(e, batch_tasks[e.group])[0] for e in experts]
        mixed = group_with_experts(local, rewards, experts, expert_rewards, groups, grpo.scale_by_std)
        return mixed.trajectories, mixed.advantages, {M.SIGNAL_OPS_MEMBERS: all_reduce_sum([len(experts)], ctx)[0]}

    def reflect(self, trajs: list[Trajectory], rng) -> dict[str, float]:
        """PRS: reflections on failed episodes (visited in an order drawn from `rng`) join the pool,
        the newest signals.reflection.pool kept. Returns signal/reflections and signal/reflection_errors
        ({} without PRS)."""
        if self.analyzer is None:
            return {}
        from keel.signals.reflection import collect_reflections, reflection_example

        r = self.cfg.reflection
        got, errors = collect_reflections(self.analyzer, rng.sample(trajs, len(trajs)), self.tasks_by_id, r.fail_at, r.per_step)
        self.reflections.extend(e for e in (reflection_example(self.tokenizer, tr, x.text, r.max_tokens) for tr, x in got) if e is not None)
        del self.reflections[: -r.pool]
        return {M.SIGNAL_REFLECTIONS: float(len(got)), M.SIGNAL_REFLECTION_ERRORS: float(errors)}

    def sync_losses(self, rng) -> list[tuple[str, float, list[SFTExample]]]:
        """Paper A's synchronous paradigm: (kind, weight, examples sampled from its pool) for each
        supervision loss added to this RL update; [] otherwise."""
        from keel.signals.schedule import sample_examples

        return [(k, self.schedule.sync_weight(k), sample_examples(self.supervision_pool(k), self.cfg.sync_examples, rng))
                for k in self.schedule.kinds if self.schedule.sync_weight(k) > 0]

    def old_from_policy(self, members: list[Trajectory], other_sampler: bool) -> list[bool]:
        """Per trajectory: take its old log-probs from the policy before the update (grpo_update's
        `old_from_policy`): every row when it was sampled by another copy of the weights (bf16
        sampler, autocast); a hinted row under signals.hint.recompute_old_logprobs, as it was
        sampled with the hint in context and is trained without it (π(·|no hint), as verl's
        recomputed old log-probs give)."""
        from keel.signals.hints import is_hinted

        hint_rule = self.cfg.hint.enabled and self.cfg.hint.recompute_old_logprobs
        return [other_sampler or (hint_rule and is_hinted(tr)) for tr in members]

    def state_dict(self) -> dict[str, Any]:
        """{"ets": ..., "hints": ... (each only when that signal is on), "reflections": [(token_ids,
        sources, task_id, turn), ...]}."""
        out: dict[str, Any] = {}
        if self.ets is not None:
            out["ets"] = self.ets.state_dict()
        if self.hint_policy is not None:
            out["hints"] = self.hint_policy.state_dict()
        out["reflections"] = [(e.token_ids, e.sources, e.task_id, e.turn) for e in self.reflections]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; a part that is absent leaves that part as it is."""
        if self.ets is not None and "ets" in state:
            self.ets.load_state_dict(state["ets"])
        if self.hint_policy is not None and "hints" in state:
            self.hint_policy.load_state_dict(state["hints"])
        if "reflections" in state:
            self.reflections = [SFTExample(*_with_sources(r)) for r in state["reflections"]]


def _with_sources(row: list) -> list:
    """A saved reflection row; rows saved before SFT rows carried sources held target flags
    (True → REFLECTION, False → PROMPT, the same loss)."""
    ids, marks, *rest = row
    if all(isinstance(m, bool) for m in marks):
        marks = [int(Source.REFLECTION) if m else int(Source.PROMPT) for m in marks]
    return [ids, marks, *rest]
