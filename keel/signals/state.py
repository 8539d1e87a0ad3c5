"""The supervision signals of one run in one object: what they are set to, and what they remember.

What a signal remembers between RL steps, and so what a checkpoint must keep:
- the hint policy: which prompts' groups last failed (`signals.hint.only_failed`)
- the ETS buffer: recently all-failed prompts and the step of their failure
- the reflection pool (PRS): the newest `signals.reflection.pool` reflection examples
`state_dict()` holds all three; `load_state_dict` restores them. The gold-trajectory cache is not
state: gold trajectories are deterministic, rebuilt on demand after a resume.
"""

from __future__ import annotations

from typing import Any

from keel.config import SignalsConfig
from keel.sft import SFTExample, decompose
from keel.signals.ets import ETSBuffer
from keel.signals.hints import HintPolicy
from keel.signals.reflection import LLMAnalyzer, RuleAnalyzer
from keel.signals.schedule import Schedule
from keel.types import Env, Task, Trajectory


class SignalState:
    """The signals' objects (None when a signal is off) and the mutable state they share."""

    def __init__(self, signals: SignalsConfig, rl_lr: float, env: Env, tokenizer, train_tasks: list[Task], tasks_by_id: dict[str, Task],
                 packed: bool):
        s = signals
        self.tokenizer, self.env, self.train_tasks, self.tasks_by_id, self.packed = tokenizer, env, train_tasks, tasks_by_id, packed
        self.schedule = Schedule.from_config(s, rl_lr)
        self.hint_policy = HintPolicy(env, s.hint.kinds, s.hint.position, s.hint.only_failed, s.hint.fail_at) if s.hint.enabled else None
        self.ets = ETSBuffer(s.ets.window, s.ets.capacity, s.ets.fail_at) if s.ets.enabled else None
        self.analyzer = None
        if s.reflection.enabled:
            self.analyzer = RuleAnalyzer(env) if s.reflection.analyzer == "rule" else LLMAnalyzer(
                s.reflection.base_url, s.reflection.model, s.reflection.api_key or None, getattr(env, "call_format", "json"))
        self.reflections: list[SFTExample] = []  # newest last, at most signals.reflection.pool
        self.gold_cache: dict[str, Trajectory] = {}  # gold trajectories, built once per task
        self._gold_examples: list[SFTExample] | None = None

    def supervision_pool(self, kind: str) -> list[SFTExample]:
        """The examples a supervision kind trains on now: gold SFT of all training tasks, the
        ETS buffer's gold trajectories, or the reflection pool."""
        from keel.signals.ops import expert_trajectory

        if kind == "sft":
            if self._gold_examples is None:
                for t in self.train_tasks:
                    if t.id not in self.gold_cache:
                        self.gold_cache[t.id] = expert_trajectory(self.tokenizer, self.env, t)
                golds = [self.gold_cache[t.id] for t in self.train_tasks]
                self._gold_examples = [e for g in golds if g.info.get("gold_ok", True) for e in decompose(g, packed=self.packed)]
            return self._gold_examples
        if kind == "ets":
            return self.ets.sft_examples(self.tokenizer, self.env, self.tasks_by_id, packed=self.packed)
        return list(self.reflections)

    def add_reflections(self, examples: list[SFTExample | None], pool: int) -> None:
        """Append the new reflection examples (None: too long, dropped); keep the newest `pool`."""
        self.reflections.extend(e for e in examples if e is not None)
        del self.reflections[:-pool]

    def state_dict(self) -> dict[str, Any]:
        """{"ets": ..., "hints": ... (each only when that signal is on), "reflections": [(token_ids,
        targets, task_id, turn), ...]}."""
        out: dict[str, Any] = {}
        if self.ets is not None:
            out["ets"] = self.ets.state_dict()
        if self.hint_policy is not None:
            out["hints"] = self.hint_policy.state_dict()
        out["reflections"] = [(e.token_ids, e.targets, e.task_id, e.turn) for e in self.reflections]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; a part that is absent leaves that part as it is."""
        if self.ets is not None and "ets" in state:
            self.ets.load_state_dict(state["ets"])
        if self.hint_policy is not None and "hints" in state:
            self.hint_policy.load_state_dict(state["hints"])
        if "reflections" in state:
            self.reflections = [SFTExample(*r) for r in state["reflections"]]
