"""Erroneous trajectory supervision (ETS, paper A): gold SFT on the queries RL keeps failing.

Paper A collects the queries whose whole GRPO group scored 0 in recent steps and turns their
gold trajectories into SFT data, applied interleaved with RL on a schedule. `ETSBuffer` is that
collection: `observe` after each RL step, `sft_examples` at a supervision phase (single-step
decomposition, `keel.sft.decompose`), `state_dict` for resume.

Where Keel departs (paper A gives no more detail): "recent" is a window of `window` RL steps
counted from a query's latest all-failed group; a later group of the same query with any reward
above `fail_at` removes it (it is no longer erroneous); at most `capacity` queries are kept, the
most recently failed ones. A query whose gold path fails in the env gives no examples.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from keel import metrics as M
from keel.config import SignalsConfig
from keel.sft import SFTExample, cached_gold_trajectory, decompose
from keel.signals.base import Signal, SignalContext
from keel.types import Env, Task, Trajectory


class ETSBuffer:
    """Task ids of recently all-failed groups, with the step of their latest failure."""

    def __init__(self, window: int = 50, capacity: int = 256, fail_at: float = 0.0) -> None:
        if window < 1:
            raise ValueError(f"signals.ets.window must be >= 1, got {window}")
        if capacity < 1:
            raise ValueError(f"signals.ets.capacity must be >= 1, got {capacity}")
        self.window = window
        self.capacity = capacity
        self.fail_at = float(fail_at)
        self.entries: OrderedDict[str, int] = OrderedDict()  # task id -> step of its latest all-failed group, oldest first

    def __len__(self) -> int:
        return len(self.entries)

    def observe(self, step: int, task_ids: Sequence[str], group_rewards: Sequence[Sequence[float]]) -> int:
        """Record the groups of RL step `step` (rewards of each group's on-policy members);
        returns how many queries entered (or re-entered) the buffer."""
        if len(task_ids) != len(group_rewards):
            raise ValueError(f"ETSBuffer.observe: {len(task_ids)} task ids but {len(group_rewards)} groups of rewards")
        entered = 0
        for tid, rewards in zip(task_ids, group_rewards):
            if not len(rewards):
                raise ValueError(f"ETSBuffer.observe: task {tid!r} has an empty group")
            if max(float(r) for r in rewards) <= self.fail_at:
                self.entries.pop(tid, None)
                self.entries[tid] = step  # move to the newest end
                entered += 1
            else:
                self.entries.pop(tid, None)
        self.expire(step)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return entered

    def expire(self, step: int) -> None:
        """Drop queries whose latest failure is `window` or more steps before `step`."""
        for tid in [t for t, s in self.entries.items() if step - s >= self.window]:
            del self.entries[tid]

    def task_ids(self) -> list[str]:
        """Buffered task ids, oldest failure first."""
        return list(self.entries)

    def sft_examples(self, tokenizer, env: Env, tasks_by_id: dict[str, Task], packed: bool = False,
                     cache: dict[str, Trajectory] | None = None) -> list[SFTExample]:
        """Single-step SFT examples (one per gold assistant turn, `keel.sft.decompose`) of every
        buffered query whose gold path works in the env. `cache`: the run's gold trajectories
        (`keel.sft.cached_gold_trajectory`; None: built here each time)."""
        out: list[SFTExample] = []
        for tid in self.entries:
            task = tasks_by_id.get(tid)
            if task is None:
                raise ValueError(f"ETSBuffer.sft_examples: buffered task {tid!r} is not among the {len(tasks_by_id)} tasks given")
            gold = cached_gold_trajectory(tokenizer, env, task, cache)
            if gold.info.get("gold_ok", True):
                out.extend(decompose(gold, packed=packed))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "capacity": self.capacity, "fail_at": self.fail_at, "entries": [[t, s] for t, s in self.entries.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the entries (window/capacity/fail_at stay as configured now: a resumed run
        may change them)."""
        entries = state.get("entries") if isinstance(state, dict) else None
        if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int) and not isinstance(e[1], bool) for e in entries
        ):
            raise ValueError("ETSBuffer.load_state_dict: expected {'entries': [[task_id, step], ...]}")
        self.entries = OrderedDict((t, s) for t, s in entries)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


class ETS(Signal):
    """`signals.ets`: prompts whose whole group failed enter the buffer; its supervision kind
    "ets" trains on their gold single-step examples."""

    name, kind = "ets", "ets"

    def __init__(self, cfg: SignalsConfig, ctx: SignalContext):
        super().__init__(cfg, ctx)
        self.buffer = ETSBuffer(cfg.ets.window, cfg.ets.capacity, cfg.ets.fail_at)

    @staticmethod
    def enabled(cfg: SignalsConfig) -> bool:
        return cfg.ets.enabled

    def observe(self, rl_step, task_ids, group_rewards):
        self.buffer.observe(rl_step, task_ids, group_rewards)
        return {M.SIGNAL_ETS_BUFFER: float(len(self.buffer))}

    def pool(self) -> list[SFTExample]:
        c = self.ctx
        return self.buffer.sft_examples(c.tokenizer, c.env, c.tasks_by_id, packed=c.packed, cache=c.gold_cache)

    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)
