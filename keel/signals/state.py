"""The supervision signals of one run in one object: what they are set to, and what they remember.

`SIGNALS` lists every signal Keel has (keel.signals.base.Signal subclasses, each in its own
module); a run builds those its `signals:` section turns on, and each call below asks them in
that order. What a signal remembers between RL steps, and so what a checkpoint must keep:
- the hint policy: which prompts' groups last failed (`signals.hint.only_failed`)
- the ETS buffer: recently all-failed prompts and the step of their failure
- the reflection pool (PRS): the newest `signals.reflection.pool` reflection examples
`state_dict()` holds them under each signal's `name` (always "reflections", empty without PRS);
`load_state_dict` restores them. The gold-trajectory cache is not state: gold trajectories are
deterministic, rebuilt on demand after a resume.

keel.train.rl_step asks the signals, in this order: `replaced_slots` and `hints` (before
sampling), `observe` (after the rewards), `members` (the rows the update trains on, with their
advantages), `reflect` (PRS), `sync_losses` (the synchronous paradigm's extra losses) and
`old_from_policy` (which rows' old log-probs the update takes from the policy); an interleaved
phase trains on `supervision_pool` of each kind it mixes.
"""

from __future__ import annotations

from typing import Any

from keel.config import GRPOConfig, SignalsConfig
from keel.distributed import DistContext, advantages
from keel.sft import SFTExample
from keel.signals.base import GoldSFT, Signal, SignalContext
from keel.signals.ets import ETS
from keel.signals.hints import Hints
from keel.signals.ops import OPS
from keel.signals.reflection import PRS
from keel.signals.schedule import Schedule, sample_examples
from keel.types import Env, Task, Trajectory

SIGNALS: tuple[type[Signal], ...] = (GoldSFT, OPS, ETS, Hints, PRS)  # a new signal adds itself here


class SignalState:
    """The signals a run's config turns on (`signals`, in SIGNALS order), the schedule of their
    supervision, and the context they share (`context`: tokenizer, env, tasks, gold cache)."""

    def __init__(self, signals: SignalsConfig, rl_lr: float, env: Env, tokenizer, train_tasks: list[Task], tasks_by_id: dict[str, Task],
                 packed: bool):
        self.cfg = signals
        self.schedule = Schedule.from_config(signals, rl_lr)
        self.context = SignalContext(tokenizer, env, train_tasks, tasks_by_id, packed)
        self.signals: list[Signal] = [cls(signals, self.context) for cls in SIGNALS if cls.enabled(signals)]

    @property
    def gold_cache(self) -> dict[str, Trajectory]:
        """The run's gold trajectories (SFT pool, ETS, OPS), built once per task."""
        return self.context.gold_cache

    def supervision_pool(self, kind: str) -> list[SFTExample]:
        """The examples a supervision kind trains on now: gold SFT of all training tasks, the
        ETS buffer's gold trajectories, or the reflection pool ([] when no signal feeds `kind`)."""
        return [e for sig in self.signals if sig.kind == kind for e in sig.pool()]

    # --- what an RL step asks of the signals, in the order it asks -------------------------------------
    def replaced_slots(self) -> int:
        """Before sampling: the group slots signals fill instead of sampled rows (OPS "replace",
        the authors' replace_num=1); 0 otherwise."""
        return sum(sig.replaced_slots() for sig in self.signals)

    def hints(self, batch_tasks: list[Task], groups: list[int]) -> tuple[list[str | None] | None, dict[str, float]]:
        """Before sampling: each row's hint (a group's rows share their task's; None: no signal
        gives hints), and the signals' metrics (signal/hinted_groups). Hints are shown while
        sampling only; collate drops them."""
        out: list[str | None] | None = None
        line: dict[str, float] = {}
        for sig in self.signals:
            per_task, got = sig.hints(batch_tasks)
            line.update(got)
            if per_task is not None:
                if out is not None:
                    raise ValueError(f"signals: two signals give hints ({type(sig).__name__} is the second); one may")
                out = [per_task[k] for k in groups]
        return out, line

    def observe(self, rl_step: int, task_ids: list[str], group_rewards: list[list[float]]) -> dict[str, float]:
        """After the rewards: each signal sees every group's outcome (its sampled members), e.g.
        queries whose whole group failed enter the ETS buffer. Returns their metrics (signal/ets_buffer)."""
        line: dict[str, float] = {}
        for sig in self.signals:
            line.update(sig.observe(rl_step, task_ids, group_rewards))
        return line

    def members(self, local: list[Trajectory], rewards, groups: list[int], batch_tasks: list[Task], mine: list[int], reward_fn,
                grpo: GRPOConfig, ctx: DistContext) -> tuple[list[Trajectory], Any, dict[str, float]]:
        """After the rewards: (the trajectories this rank's update trains on, their advantages,
        metrics). The sampled rows with GRPO's advantages (`keel.distributed.advantages`) unless a
        signal changes them: with OPS each of this rank's groups (`mine`) gains its gold members
        and advantages are taken over both kinds (Eq. 4)."""
        for sig in self.signals:
            got = sig.members(local, rewards, groups, batch_tasks, mine, reward_fn, grpo, ctx)
            if got is not None:
                return got
        return local, advantages(rewards, groups, grpo, ctx), {}

    def reflect(self, trajs: list[Trajectory], rng) -> dict[str, float]:
        """PRS: reflections on failed episodes join the pool. Returns signal/reflections and
        signal/reflection_errors ({} without PRS)."""
        line: dict[str, float] = {}
        for sig in self.signals:
            line.update(sig.reflect(trajs, rng))
        return line

    def sync_losses(self, rng) -> list[tuple[str, float, list[SFTExample]]]:
        """Paper A's synchronous paradigm: (kind, weight, examples sampled from its pool) for each
        supervision loss added to this RL update; [] otherwise."""
        return [(k, self.schedule.sync_weight(k), sample_examples(self.supervision_pool(k), self.cfg.sync_examples, rng))
                for k in self.schedule.kinds if self.schedule.sync_weight(k) > 0]

    def old_from_policy(self, members: list[Trajectory], other_sampler: bool) -> list[bool]:
        """Per trajectory: take its old log-probs from the policy before the update (grpo_update's
        `old_from_policy`): every row when it was sampled by another copy of the weights (bf16
        sampler, autocast), else the rows a signal asks for (a hinted row under
        signals.hint.recompute_old_logprobs)."""
        return [other_sampler or any(sig.old_from_policy(tr) for sig in self.signals) for tr in members]

    def state_dict(self) -> dict[str, Any]:
        """{"ets": ..., "hints": ... (each only when that signal is on), "reflections": [(token_ids,
        sources, task_id, turn), ...]}."""
        out: dict[str, Any] = {sig.name: sig.state_dict() for sig in self.signals if sig.name}
        out.setdefault("reflections", [])
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; a part that is absent leaves that part as it is."""
        for sig in self.signals:
            if sig.name and sig.name in state:
                sig.load_state_dict(state[sig.name])
