"""What a supervision signal is to the RL loop: an object with hooks, each a no-op by default.

keel.train.rl_step calls the hooks through keel.signals.state.SignalState, in this order:
`replaced_slots` (before sampling: group slots the signal fills itself), `hints` (before
sampling), `observe` (after the rewards), `members` (the rows the update trains on, with their
advantages), `reflect` (on the step's trajectories), `old_from_policy` (per trained row);
between RL steps a supervision phase trains on `pool()` of the signals whose `kind` it mixes.
`state_dict` / `load_state_dict` carry what the signal remembers across a checkpoint.

A new signal is a subclass in its own module, a section of `signals:` in keel.config (a
`SignalSection`, which says whether it needs gold trajectories, the Hermes layout or one
process) and one entry in keel.signals.state.SIGNALS; it overrides only the hooks it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.config import SignalsConfig
from keel.sft import SFTExample, cached_gold_trajectory, decompose
from keel.types import Env, Task, Trajectory


@dataclass
class SignalContext:
    """What the signals of one run share: the tokenizer, the env, the training tasks, whether
    SFT rows are packed, and the gold-trajectory cache (task id → trajectory, built once per task;
    not state a checkpoint keeps: gold trajectories are deterministic)."""

    tokenizer: Any
    env: Env
    train_tasks: list[Task]
    tasks_by_id: dict[str, Task]
    packed: bool
    gold_cache: dict[str, Trajectory] = field(default_factory=dict)

    def gold(self, task: Task) -> Trajectory:
        return cached_gold_trajectory(self.tokenizer, self.env, task, self.gold_cache)


class Signal:
    """One supervision signal of a run. `name`: its key in the checkpoint's signal state (""
    when it keeps none); `kind`: the supervision data kind its `pool` feeds ("" for none)."""

    name = ""
    kind = ""

    def __init__(self, cfg: SignalsConfig, ctx: SignalContext):
        self.cfg, self.ctx = cfg, ctx

    @staticmethod
    def enabled(cfg: SignalsConfig) -> bool:
        """Whether `cfg` turns this signal on (SignalState builds only those)."""
        raise NotImplementedError

    def replaced_slots(self) -> int:
        """Group slots per prompt this signal fills instead of the sampler."""
        return 0

    def hints(self, batch_tasks: list[Task]) -> tuple[list[str | None] | None, dict[str, float]]:
        """Each task's hint while sampling (None: this signal gives none), and its metrics."""
        return None, {}

    def observe(self, rl_step: int, task_ids: list[str], group_rewards: list[list[float]]) -> dict[str, float]:
        """Each group's sampled rewards, after they are computed; returns metrics."""
        return {}

    def members(self, local: list[Trajectory], rewards, groups: list[int], batch_tasks: list[Task], mine: list[int],
                reward_fn, grpo, ctx) -> tuple[list[Trajectory], Any, dict[str, float]] | None:
        """The rows the update trains on with their advantages and metrics, or None to leave
        them as sampled (see SignalState.members)."""
        return None

    def reflect(self, trajs: list[Trajectory], rng) -> dict[str, float]:
        """The step's trajectories, after the update's rows are fixed; returns metrics."""
        return {}

    def pool(self) -> list[SFTExample]:
        """The examples of this signal's supervision kind, now."""
        return []

    def old_from_policy(self, traj: Trajectory) -> bool:
        """Whether the update takes this trained row's old log-probs from the policy."""
        return False

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class GoldSFT(Signal):
    """`signals.sft`: gold SFT of every training task as a supervision kind (paper A's
    synchronous / interleaved SFT). Its pool is built once: gold trajectories are deterministic."""

    kind = "sft"

    def __init__(self, cfg: SignalsConfig, ctx: SignalContext):
        super().__init__(cfg, ctx)
        self._examples: list[SFTExample] | None = None

    @staticmethod
    def enabled(cfg: SignalsConfig) -> bool:
        return cfg.sft

    def pool(self) -> list[SFTExample]:
        if self._examples is None:
            golds = [self.ctx.gold(t) for t in self.ctx.train_tasks]
            self._examples = [e for g in golds if g.info.get("gold_ok", True) for e in decompose(g, packed=self.ctx.packed)]
        return self._examples
