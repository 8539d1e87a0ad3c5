"""When supervision enters training, as data: synchronous (one update) or interleaved (phases).

Paper A compares two paradigms for its supervision signals. *Synchronous*: the supervision loss
is added, with a weight, to the RL loss of the same update (it found this can itself cause KL
spikes through token-distribution mismatch). *Interleaved*: RL and supervision phases alternate
(their schedule: SFT after RL steps 50/100/150, 2 epochs each at batch 128, lr 1e-5 — with
interleaving 1e-5 beat 1e-6). `Schedule` holds that choice as data and answers two questions:
`phase_after(step)` (run a supervision phase now? with which data, epochs, lr) and
`sync_weight(kind)` (weight of a supervision loss inside the RL update).

The `signals:` section of the run config (SignalsConfig) is declared and checked in keel.config
with every other section; `Schedule.from_config` turns it into a schedule. `keel.sft.supervision_backward`
(re-exported here) and `run_phase` are the two ways the loop applies a supervision loss; `run_phase` gives the same update as train.py's `sft_step` (tested).
Where Keel departs: a supervision phase uses its own AdamW, created fresh for the phase, so
Adam moments of SFT and RL never mix (paper A does not say); supervision data kinds are "sft"
(gold trajectories of all training tasks), "ets" (gold of recently failed tasks) and
"reflection" (PRS examples), mixed in one phase when several are on.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

from keel.config import SUPERVISION_KINDS, Config, SignalsConfig, apply_dict, check_signals, supervision_kinds
from keel.sft import supervision_backward  # noqa: F401  (re-exported: the phases below and the synchronous paradigm use it)


def signals_from_dict(d: dict[str, Any]) -> SignalsConfig:
    """A SignalsConfig from a nested mapping (as in YAML), set and type-checked as `signals:` in
    a preset is; an unknown key or a wrong type is a one-line ConfigError naming the key."""
    cfg = Config()
    apply_dict(cfg, {"signals": d})
    return cfg.signals


# --- the schedule -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisionPhase:
    """One interleaved supervision phase: `epochs` over the examples of `sources` at `lr`.
    `kind` labels it in logs ("sft", "ets+reflection", ...)."""

    kind: str
    epochs: int
    lr: float
    sources: tuple[str, ...]
    batch_size: int


@dataclass(frozen=True)
class Schedule:
    paradigm: str
    kinds: tuple[str, ...]  # supervision data kinds that are on, in SUPERVISION_KINDS order
    at_steps: tuple[int, ...] = ()
    every: int = 0
    epochs: int = 2
    lr: float = 1e-5
    rl_lr: float = 1e-6
    batch_size: int = 8
    sync_examples: int = 8
    weights: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_config(cls, signals: SignalsConfig | dict[str, Any], rl_lr: float) -> "Schedule":
        """The schedule of a `signals:` section (dataclass or mapping); `rl_lr` is grpo.lr.
        Inconsistent settings are one-line errors naming the key."""
        s = signals_from_dict(signals) if isinstance(signals, dict) else signals
        check_signals(s)
        kinds, at_steps = supervision_kinds(s), tuple(s.at_steps)
        weights = (("sft", float(s.sft_weight)), ("ets", float(s.ets_weight)), ("reflection", float(s.reflection_weight)))
        return cls(s.paradigm, kinds, at_steps, s.every, s.epochs, float(s.lr), float(rl_lr), s.batch_size, s.sync_examples, weights)

    def phase_after(self, step: int) -> SupervisionPhase | None:
        """The supervision phase to run after RL step `step` (1-based), or None.

        Worked example, paper A: interleaved, kinds ("sft",), at_steps (50, 100, 150) →
        phase_after(50) = SupervisionPhase("sft", 2, 1e-5, ("sft",), 128), phase_after(51) = None.
        """
        if self.paradigm != "interleaved" or not self.kinds:
            return None
        if step in self.at_steps or (self.every and step % self.every == 0):
            return SupervisionPhase("+".join(self.kinds), self.epochs, self.lr, self.kinds, self.batch_size)
        return None

    def sync_weight(self, kind: str) -> float:
        """Weight of `kind`'s loss inside the RL update: its configured weight when the paradigm
        is synchronous and the kind is on, else 0."""
        if kind not in SUPERVISION_KINDS:
            raise ValueError(f"unknown supervision kind {kind!r} (known: {', '.join(SUPERVISION_KINDS)})")
        if self.paradigm != "synchronous" or kind not in self.kinds:
            return 0.0
        return dict(self.weights)[kind]


# --- applying a supervision loss (keel.sft.supervision_backward) --------------------------------------


def run_phase(model, examples: Sequence, phase: SupervisionPhase, pad_id: int, max_grad_norm: float,
              rng: random.Random, micro: int = 8, optimizer=None, autocast: bool = False,
              max_tokens: int = 0, keep_prefix_graph: bool = True) -> list[dict[str, float]]:
    """An interleaved supervision phase: `phase.epochs` shuffled passes over the examples in
    batches of `phase.batch_size`, one optimizer step per batch (a fresh AdamW at `phase.lr`
    unless `optimizer` is given). Returns one stats line per step (keel.metrics names).
    `keep_prefix_graph` as `keel.sft.supervision_backward`'s."""
    import torch

    from keel import metrics as M
    from keel.models import adamw

    if not examples:
        return []
    was_training = model.training
    model.train()
    opt = optimizer or adamw(model.parameters(), lr=phase.lr)
    lines = []
    for _epoch in range(phase.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for s in range(0, len(order), phase.batch_size):
            batch = [examples[i] for i in order[s : s + phase.batch_size]]
            opt.zero_grad(set_to_none=True)
            loss = supervision_backward(model, batch, pad_id, 1.0, micro, autocast, max_tokens, keep_prefix_graph)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            skipped = not (math.isfinite(loss) and torch.isfinite(norm))
            if skipped:  # a NaN must not poison the weights
                opt.zero_grad(set_to_none=True)
            else:
                opt.step()
            lines.append({M.LOSS_SFT: loss, M.LOSS_GRAD_NORM: float(norm), M.LOSS_SKIPPED: float(skipped),
                          M.SIGNAL_SFT_EXAMPLES: float(len(batch)), M.OPTIM_LR: phase.lr})
    if not was_training:
        model.eval()
    return lines


def sample_examples(pool: Sequence, n: int, rng: random.Random) -> list:
    """n examples drawn without replacement (all of them when the pool is smaller)."""
    if n >= len(pool):
        return list(pool)
    return rng.sample(list(pool), n)
