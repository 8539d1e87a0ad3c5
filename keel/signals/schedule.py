"""When supervision enters training, as data: synchronous (one update) or interleaved (phases).

Paper A compares two paradigms for its supervision signals. *Synchronous*: the supervision loss
is added, with a weight, to the RL loss of the same update (it found this can itself cause KL
spikes through token-distribution mismatch). *Interleaved*: RL and supervision phases alternate
(their schedule: SFT after RL steps 50/100/150, 2 epochs each at batch 128, lr 1e-5 — with
interleaving 1e-5 beat 1e-6). `Schedule` holds that choice as data and answers two questions:
`phase_after(step)` (run a supervision phase now? with which data, epochs, lr) and
`sync_weight(kind)` (weight of a supervision loss inside the RL update).

`SignalsConfig` is the `signals:` section of the run config (documented per field, like every
section of keel.config). `supervision_backward` and `run_phase` are the two ways the loop applies
a supervision loss; `run_phase` gives the same update as train.py's `sft_step` (tested).
Where Keel departs: a supervision phase uses its own AdamW, created fresh for the phase, so
Adam moments of SFT and RL never mix (paper A does not say); supervision data kinds are "sft"
(gold trajectories of all training tasks), "ets" (gold of recently failed tasks) and
"reflection" (PRS examples), mixed in one phase when several are on.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

KINDS = ("sft", "ets", "reflection")
PARADIGMS = ("synchronous", "interleaved")


from keel.config import doc as _doc  # the one field-with-documentation helper


# --- the `signals:` config section ------------------------------------------------------------------


@dataclass
class OPSConfig:
    enabled: bool = _doc(False, "off-policy supervision: gold trajectories become members of every GRPO group")
    mode: str = _doc("replace", "replace: `members` of the group_size slots hold the gold trajectory (authors' replace_num) | add: they join the group_size sampled ones (Eq. 4)")
    members: int = _doc(1, "gold members per group (authors: replace_num=1 of n=8)")


@dataclass
class HintConfig:
    enabled: bool = _doc(False, "hint-based guidance: a hint in the prompt while sampling, removed for the update")
    kinds: list[str] = _doc(["first_call", "relation_path"], "hint texts, keys of keel.signals.hints.HINTS: first_call, relation_path, function_names")
    position: str = _doc("system", "system (end of the system instructions, authors' placement) | user (end of the first user message)")
    only_failed: bool = _doc(False, "hint a prompt only if its whole group scored <= fail_at the last time it was sampled")
    fail_at: float = _doc(0.0, "a group whose every reward is <= this counts as failed")
    recompute_old_logprobs: bool = _doc(True, "old log-probs of hinted rows = the current policy on the hint-free sequence (ratio 1, as verl); false: the sampling ones")


@dataclass
class ETSConfig:
    enabled: bool = _doc(False, "erroneous trajectory supervision: gold SFT on prompts whose whole group failed")
    window: int = _doc(50, "a failed prompt stays eligible for this many RL steps after its latest all-failed group")
    capacity: int = _doc(256, "most prompts kept (the most recently failed)")
    fail_at: float = _doc(0.0, "a group whose every reward is <= this counts as failed")


@dataclass
class ReflectionConfig:
    enabled: bool = _doc(False, "process reflection supervision: train the policy to write an analyzer's reflection on its failed trajectories")
    analyzer: str = _doc("rule", "rule (offline, replays the gold path) | llm (an OpenAI-compatible endpoint)")
    base_url: str = _doc("", "llm analyzer: endpoint base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = _doc("", "llm analyzer: model name sent to the endpoint")
    api_key: str = _doc("", "llm analyzer: API key (empty: the OPENAI_API_KEY environment variable, else none)")
    per_step: int = _doc(8, "reflections written per RL step, on failed trajectories")
    pool: int = _doc(512, "most recent reflection examples kept for supervision")
    max_tokens: int = _doc(2048, "longest reflection example (trajectory + request + reflection); longer ones are dropped")
    fail_at: float = _doc(0.0, "a trajectory with reward <= this is reflected on")


@dataclass
class SelfDistillConfig:
    trajectories: str = _doc("", "JSONL of kept episodes (keel.signals.restem.write_trajectories); set: the SFT warm-start trains on them instead of gold")


@dataclass
class SignalsConfig:
    """Paper A's supervision signals and paper B's self-distillation."""

    paradigm: str = _doc("interleaved", "how sft/ets/reflection losses enter: synchronous (weighted, inside each RL update) | interleaved (supervision phases between RL steps)")
    sft: bool = _doc(False, "gold SFT of all training tasks as a supervision signal during RL (paper A's synchronous / interleaved SFT)")
    at_steps: list[int] = _doc([], "interleaved: a supervision phase after each of these RL steps (paper A: 50, 100, 150)")
    every: int = _doc(0, "interleaved: also a phase after every N RL steps (0: off)")
    epochs: int = _doc(2, "interleaved: epochs over the phase's examples (paper A: 2)")
    lr: float = _doc(1e-5, "learning rate of supervision phases (paper A: 1e-5); RL keeps grpo.lr")
    batch_size: int = _doc(8, "examples per supervision step (paper A: 128)")
    sync_examples: int = _doc(8, "synchronous: examples of each kind added to every RL update")
    sft_weight: float = _doc(1.0, "synchronous: weight of the gold SFT loss")
    ets_weight: float = _doc(1.0, "synchronous: weight of the ETS loss")
    reflection_weight: float = _doc(1.0, "synchronous: weight of the reflection loss (Eq. 10)")
    ops: OPSConfig = field(default_factory=OPSConfig)
    hint: HintConfig = field(default_factory=HintConfig)
    ets: ETSConfig = field(default_factory=ETSConfig)
    reflection: ReflectionConfig = field(default_factory=ReflectionConfig)
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)


def signals_from_dict(d: dict[str, Any], where: str = "signals") -> SignalsConfig:
    """A SignalsConfig from a nested mapping (as in YAML); unknown keys are one-line errors."""

    def fill(obj, data: dict[str, Any], prefix: str):
        if not isinstance(data, dict):
            raise ValueError(f"{prefix}: expected a mapping, got {type(data).__name__}")
        names = {f.name: f for f in dataclasses.fields(obj)}
        for k, v in data.items():
            if k not in names:
                raise ValueError(f"unknown config key '{prefix}.{k}' (known: {', '.join(names)})")
            current = getattr(obj, k)
            if dataclasses.is_dataclass(current):
                fill(current, v, f"{prefix}.{k}")
                continue
            expected = type(current)
            if expected is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, expected) or (expected is not bool and isinstance(v, bool)):
                raise ValueError(f"config key '{prefix}.{k}' expects {expected.__name__}, got {v!r}")
            setattr(obj, k, v)
        return obj

    return fill(SignalsConfig(), d, where)


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
    kinds: tuple[str, ...]  # supervision data kinds that are on, in KINDS order
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
        kinds = tuple(k for k, on in (("sft", s.sft), ("ets", s.ets.enabled), ("reflection", s.reflection.enabled)) if on)
        at_steps = tuple(s.at_steps)
        checks = [
            (s.paradigm in PARADIGMS, f"signals.paradigm must be one of {PARADIGMS}, got {s.paradigm!r}"),
            (all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in at_steps), f"signals.at_steps must be RL steps >= 1, got {list(at_steps)}"),
            (list(at_steps) == sorted(set(at_steps)), f"signals.at_steps must be increasing without repeats, got {list(at_steps)}"),
            (s.every >= 0, f"signals.every must be >= 0, got {s.every}"),
            (s.epochs >= 1, f"signals.epochs must be >= 1, got {s.epochs}"),
            (s.lr > 0 and math.isfinite(s.lr), f"signals.lr must be a positive number, got {s.lr}"),
            (s.batch_size >= 1, f"signals.batch_size must be >= 1, got {s.batch_size}"),
            (s.sync_examples >= 1, f"signals.sync_examples must be >= 1, got {s.sync_examples}"),
            (min(s.sft_weight, s.ets_weight, s.reflection_weight) >= 0, "signals.*_weight must be >= 0"),
            (s.ops.mode in ("replace", "add"), f"signals.ops.mode must be replace or add, got {s.ops.mode!r}"),
            (s.ops.members >= 1 or not s.ops.enabled, f"signals.ops.members must be >= 1, got {s.ops.members}"),
            (s.reflection.analyzer in ("rule", "llm"), f"signals.reflection.analyzer must be rule or llm, got {s.reflection.analyzer!r}"),
            (s.reflection.analyzer != "llm" or not s.reflection.enabled or (s.reflection.base_url and s.reflection.model),
             "signals.reflection.analyzer=llm needs signals.reflection.base_url and signals.reflection.model"),
            (not (s.paradigm == "synchronous" and (at_steps or s.every)), "signals.at_steps / signals.every apply to the interleaved paradigm only"),
            (not (s.paradigm == "interleaved" and kinds and not (at_steps or s.every)),
             f"signals: {'/'.join(kinds)} is on with paradigm interleaved but no phase is scheduled; set signals.at_steps or signals.every"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
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
        if kind not in KINDS:
            raise ValueError(f"unknown supervision kind {kind!r} (known: {', '.join(KINDS)})")
        if self.paradigm != "synchronous" or kind not in self.kinds:
            return 0.0
        return dict(self.weights)[kind]


# --- applying a supervision loss ------------------------------------------------------------------------


def supervision_backward(model, examples: Sequence, pad_id: int, weight: float = 1.0, micro: int = 8, autocast: bool = False,
                         max_tokens: int = 0) -> float:
    """Accumulate gradients of weight · NLL over the examples' targets (token-mean over all of
    them, `keel.losses.sft_loss`); no optimizer step. Returns the unweighted loss.

    Synchronous paradigm: call it inside the RL update, after the GRPO micro-batches' backward
    and before gradient clipping, once per kind with `Schedule.sync_weight(kind)`.
    `autocast`: bf16 autocast of the forward, as train.py's `model.autocast`; micro-batches hold at
    most `micro` examples and `max_tokens` encoded positions (`keel.logprobs.micro_batches`), and
    the examples' common prefix is encoded once for all of them (`keel.logprobs.SharedPrefix`).
    train.py's `sft_step` is this plus the optimizer step.
    """
    import torch

    from keel.logprobs import micro_batches, token_logprobs, update_prefix
    from keel.losses import sft_loss
    from keel.sft import collate_sft

    if not examples:
        return 0.0
    n_targets = sum(sum(e.targets[1:]) for e in examples)
    total = 0.0
    device = next(model.parameters()).device
    sequences = [e.token_ids for e in examples]
    parts = micro_batches(sequences, micro, max_tokens)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        prefix = update_prefix(model, sequences, parts)
    for idx in parts:
        ids, attn, tmask = collate_sft([examples[i] for i in idx], pad_id)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logp, _ = token_logprobs(model, ids.to(device), attn.to(device), tmask.to(device), prefix=prefix)
        loss = sft_loss(logp, n_targets)
        (loss * weight).backward()
        total += float(loss.detach())
    if prefix is not None:
        prefix.backward()
    return total


def run_phase(model, examples: Sequence, phase: SupervisionPhase, pad_id: int, max_grad_norm: float,
              rng: random.Random, micro: int = 8, optimizer=None, autocast: bool = False,
              max_tokens: int = 0) -> list[dict[str, float]]:
    """An interleaved supervision phase: `phase.epochs` shuffled passes over the examples in
    batches of `phase.batch_size`, one optimizer step per batch (a fresh AdamW at `phase.lr`
    unless `optimizer` is given). Returns one stats line per step (keel.metrics names)."""
    import torch

    from keel import metrics as M

    if not examples:
        return []
    was_training = model.training
    model.train()
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=phase.lr, weight_decay=0.0)
    lines = []
    for _epoch in range(phase.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for s in range(0, len(order), phase.batch_size):
            batch = [examples[i] for i in order[s : s + phase.batch_size]]
            opt.zero_grad(set_to_none=True)
            loss = supervision_backward(model, batch, pad_id, 1.0, micro, autocast, max_tokens)
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
