"""Data-parallel GRPO over several processes: each rank rolls out and trains on its share of a
step's groups, and one weighted gradient all-reduce makes the update equal to one process's.

The idea is DDP's: every rank starts from the same weights, computes gradients on its shard,
the gradients are combined across ranks, and every rank takes the same optimizer step, so the
weights stay identical without ever being sent.

Where Keel departs from `torch.nn.parallel.DistributedDataParallel`:
- DDP *averages* gradients (÷ world size). That equals the one-process gradient only when
  every rank's loss has the same normaliser. Keel's token-mean loss divides by the number of
  policy tokens of the *whole* batch, and ranks hold different counts (e.g. 1,130 vs 870
  tokens), so the average would weigh each token by 1/(2·1,130) on one rank and 1/(2·870) on
  the other. Here each rank's gradient (computed with its local normaliser N_r) is multiplied
  by N_r / N (N = all-reduced sum of the N_r) and the ranks are *summed*:
  Σ_r (N_r/N)·(1/N_r)·Σ_{tokens of r} ∇ = (1/N)·Σ_{all tokens} ∇, exactly the one-process gradient.
  For "seq-mean-token-mean" the normaliser is the number of trained sequences instead.
- The all-reduce happens once per step, after all local micro-batches, in one flattened
  collective (`GradientSync.commit`), not bucket by bucket during backward: `token_logprobs`
  calls the decoder body and the LM head directly, which bypasses a DDP wrapper's forward (and
  with it DDP's gradient hooks). One 135M-parameter all-reduce per step (540 MB fp32) costs
  ~0.5 s over gloo on one host — small next to a ~60 s rollout.
- Gradient clipping and the non-finite skip are decided on the *global* gradient, in `commit`,
  so every rank clips by the same factor and skips together (a rank that skipped alone would
  never join the all-reduce, and the others would wait forever). `grpo_update` must therefore
  run with clipping switched off (`local_grpo(g)` sets max_grad_norm = inf, where
  torch's clip factor is min(1, inf) = 1: an exact no-op).

Used from the training loop (keel.train.rl_step) as:

    ctx = init_distributed()                          # one process: rank 0 of 1, no-op
    mine = shard_groups(cfg.rollout.prompts_per_step, ctx)
    ...rollout and rewards for this rank's groups only (a group never spans ranks)...
    adv = advantages(rewards, groups, cfg.grpo, ctx)  # grpo.baseline=batch: one all-reduce
    update = ShardedUpdate(optimizer, model, trajs, adv, cfg.grpo, ctx)  # GradientSync, begun
    stats = update.finish(grpo_update(model, ref, update.optimizer, trajs, adv, update.grpo, ...))
    sink = gather_telemetry(sink, len(trajs), ctx)    # every rank, always
    if ctx.is_main: ...write metrics, checkpoints, reports...
The SFT warm-start's steps go through `sharded_sft_step`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from keel import metrics as M
from keel.errors import UserError
from keel.losses import batch_advantages, batch_stats, group_advantages
from keel.types import Source, Trajectory


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank r of world_size processes (rank 0 of 1 when alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Only the main process writes files (metrics, checkpoints, reports) and prints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"distributed: environment variable {name}={raw!r} is not an integer") from None


def init_distributed(backend: str | None = None) -> DistContext:
    """The context of this process, from the variables `torchrun` / `accelerate launch` set.

    WORLD_SIZE, RANK, LOCAL_RANK (and MASTER_ADDR/MASTER_PORT, read by torch). Without them this
    is one process (rank 0 of 1) and nothing is initialised. Backend: gloo on CPU, nccl when
    CUDA is available, unless `backend` says otherwise. A process group that is already
    initialised (e.g. by `accelerate.Accelerator()`) is reused.
    """
    if dist.is_available() and dist.is_initialized():
        return DistContext(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", dist.get_rank()))
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"distributed: RANK={rank} is not within WORLD_SIZE={world}")
    if world == 1:
        return DistContext()
    if not dist.is_available():
        raise RuntimeError("distributed: WORLD_SIZE > 1 but this torch build has no torch.distributed")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(rank, world, local)


def shard_groups(n_groups: int, ctx: DistContext) -> range:
    """The contiguous block of a step's group indices that this rank rolls out and trains on.

    A group (all rollouts of one prompt) never spans ranks, so group advantages stay local and
    exact. Worked example: 8 groups on 2 ranks → rank 0: range(0, 4), rank 1: range(4, 8).
    Uneven shards would be exact too (the gradient weights take care of it) but make ranks wait
    for the slowest, so they are refused.
    """
    if n_groups < 1:
        raise UserError(f"distributed: {n_groups} groups per step; need at least one per rank")
    if n_groups % ctx.world_size:
        raise UserError(
            f"rollout.prompts_per_step={n_groups} is not a multiple of the {ctx.world_size} processes; "
            f"use {(n_groups // ctx.world_size + 1) * ctx.world_size}"
        )
    per = n_groups // ctx.world_size
    return range(ctx.rank * per, (ctx.rank + 1) * per)


def loss_normaliser(trajectories: Sequence[Trajectory], advantages: torch.Tensor, aggregation: str, skip_zero_advantage: bool = True) -> int:
    """The local normaliser `grpo_update` divides this rank's loss by.

    "token-mean": trained tokens (policy and expert, the first token excluded) of the members
    that are trained; "seq-mean-token-mean": the number of trained members. A member is
    skipped when `skip_zero_advantage` and its advantage is exactly 0 (as in `grpo_update`).
    Worked example: sources [0,1,1,2,1] and [0,4,1] with advantages [0.5, 0] →
    token-mean 3 (the second member is skipped), seq-mean-token-mean 1.
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"loss_normaliser: {len(trajectories)} trajectories but {len(advantages)} advantages")
    members = [i for i in range(len(trajectories)) if not (skip_zero_advantage and float(advantages[i]) == 0.0)]
    if aggregation == "token-mean":
        trained = (Source.POLICY, Source.EXPERT)
        return sum(1 for i in members for s in trajectories[i].sources[1:] if s in trained)
    if aggregation == "seq-mean-token-mean":
        return len(members)
    raise ValueError(f"grpo.loss_aggregation: {aggregation!r} is not 'token-mean' or 'seq-mean-token-mean'")


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Element-wise sum over ranks (float64, so token counts up to 2^53 stay exact)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if ctx.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def local_grpo(g):
    """A copy of the GRPO section for `grpo_update` under `GradientSync`: local clipping off
    (GradientSync clips the global gradient). clip_grad_norm_ with max_norm=inf multiplies by
    min(1, inf)=1."""
    return dataclasses.replace(g, max_grad_norm=math.inf)


def broadcast_parameters(model: torch.nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's parameters and buffers to every rank (a seeded init is already identical;
    this makes it certain, e.g. after loading a checkpoint on rank 0 only)."""
    if not ctx.enabled:
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


class GradientSync:
    """An optimizer stand-in for `grpo_update` that defers the step until the gradients of all
    ranks are combined.

    `grpo_update` calls `zero_grad()` at its start, then `step()` (or `zero_grad()` again when
    its loss is not finite, or nothing at all when no member of this rank is trained); these
    calls are only recorded. `commit()`, called by *every* rank after `grpo_update`, does the
    one collective: Σ_r weight_r · grad_r plus two flags (any rank not finite, any rank trained),
    then clips the global gradient and steps, or skips on every rank together.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter], ctx: DistContext, max_grad_norm: float) -> None:
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        seen: set[int] = set()
        self.params = [p for p in self.params if not (id(p) in seen or seen.add(id(p)))]  # tied weights once
        self.ctx = ctx
        self.max_grad_norm = max_grad_norm
        self.weight = 1.0
        self._zero_grads = 0
        self._stepped = False

    @property
    def param_groups(self):  # lets an LR scheduler drive the wrapped optimizer
        return self.optimizer.param_groups

    def begin(self, weight: float) -> None:
        """Start a step; `weight` = this rank's normaliser / the global normaliser."""
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"GradientSync.begin: weight {weight} is not a finite non-negative number")
        self.weight = weight
        self._zero_grads = 0
        self._stepped = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grads += 1
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self._stepped = True

    def commit(self) -> dict[str, float]:
        """Combine, clip and step (or skip) on every rank. Returns the global grad norm and skip flag."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]) * self.weight
        local_bad = (self._zero_grads >= 2 and not self._stepped) or not bool(torch.isfinite(flat).all())
        flags = torch.tensor([float(local_bad), float(self._stepped)], dtype=flat.dtype)
        buf = torch.cat([torch.where(torch.isfinite(flat), flat, torch.zeros_like(flat)), flags])
        if self.ctx.enabled:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        any_bad, any_stepped = buf[-2].item() > 0, buf[-1].item() > 0
        out = {M.LOSS_GRAD_NORM: 0.0, M.LOSS_SKIPPED: float(any_bad)}
        if any_bad or not any_stepped:
            # nothing trained anywhere, or a NaN/inf somewhere: no rank steps (same as one process)
            self.optimizer.zero_grad(set_to_none=True)
            return out
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = buf[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        out[M.LOSS_GRAD_NORM] = float(norm)
        return out


# Keys of grpo_update's stats, by how a global value is formed from the ranks' local ones.
_LOSS_KEYS = (M.LOSS_POLICY, M.LOSS_KL, M.LOSS_TOTAL)  # local sums / local normaliser → × weight, summed
_PER_TOKEN_KEYS = (M.KL_K1_MEAN, M.KL_K3_MEAN, M.KL_MEAN, M.LOSS_CLIP_LOW, M.LOSS_CLIP_HIGH, M.LOSS_RATIO_MEAN, M.TOKENS_ENTROPY)
_COUNT_KEYS = (M.LOSS_TRAINED_MEMBERS,)


def reduce_stats(stats: dict[str, float], loss_weight: float, token_weight: float, ctx: DistContext) -> dict[str, float]:
    """Global values of `grpo_update`'s local stats.

    Losses were divided by the local normaliser: global = Σ_r loss_weight_r · value_r.
    Per-token means were divided by the local trained-token count: global = Σ_r token_weight_r · value_r.
    Counts are summed. Other keys are returned as this rank's (grad norm and skip come from
    `GradientSync.commit`, which is already global).
    Worked example (token-mean, so both weights are N_r/N): ranks with 30 and 10 tokens and
    entropy 1.0 and 2.0 → 0.75·1.0 + 0.25·2.0 = 1.25, the mean over all 40 tokens.
    """
    keys = [k for k in _LOSS_KEYS + _PER_TOKEN_KEYS + _COUNT_KEYS if k in stats]
    local = [stats[k] * (loss_weight if k in _LOSS_KEYS else token_weight if k in _PER_TOKEN_KEYS else 1.0) for k in keys]
    out = dict(stats)
    out.update(zip(keys, all_reduce_sum(local, ctx)))
    return out


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; for trajectories and records
    that the main process writes)."""
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank (e.g. the run directory rank 0 chose)."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (e.g. until rank 0 has written a checkpoint the others will read)."""
    if ctx.enabled:
        dist.barrier()


def row_seed(seed: int, step: int, group: int, member: int) -> int:
    """The sampling seed of one rollout row: a hash of (run seed, RL step, group, member), so a
    row samples the same tokens whichever rank or batch it lands in, and a resumed run needs no
    generator state. 64 bits of BLAKE2b over the four numbers: distinct rows get distinct seeds."""
    key = f"{seed}:{step}:{group}:{member}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2**63


def advantages(rewards: torch.Tensor, groups: list[int], g, ctx: DistContext) -> torch.Tensor:
    """This rank's advantages [N] under `g.baseline` (g: the GRPO section): centred on each
    group's mean (GRPO; a group never spans ranks, so this is local), or on the mean of the whole
    step's batch over every rank (`batch`, one all-reduce of the sum, sum of squares and count)."""
    if g.baseline == "batch":
        total, total_sq, n = all_reduce_sum([float(rewards.sum()), float((rewards.float() ** 2).sum()), float(len(rewards))], ctx)
        return batch_advantages(rewards, *batch_stats(total, total_sq, n), g.scale_by_std)
    return group_advantages(rewards, torch.tensor(groups, dtype=torch.long), g.scale_by_std)


class ShardedUpdate:
    """One GRPO update under several processes, around `grpo_update`; a pass-through in one.

    On creation: this rank's share of the step's global normalisers (`loss_normaliser` of the
    loss aggregation, and of token-mean for the per-token statistics), and a `GradientSync`
    begun with the loss share. `optimizer` and `grpo` (clipping off, `local_grpo`) are what
    `grpo_update` takes; `finish(stats)` commits the gradient on every rank and returns the
    global statistics (`reduce_stats`).
    """

    def __init__(self, optimizer, model: torch.nn.Module, trajectories: Sequence[Trajectory], advantages: torch.Tensor, g, ctx: DistContext):
        self.ctx, self.optimizer, self.grpo = ctx, optimizer, g
        if not ctx.enabled:
            return
        n_local = loss_normaliser(trajectories, advantages, g.loss_aggregation, g.skip_zero_advantage)
        t_local = loss_normaliser(trajectories, advantages, "token-mean", g.skip_zero_advantage)
        n_global, t_global = all_reduce_sum([n_local, t_local], ctx)
        self.loss_weight = n_local / n_global if n_global else 0.0
        self.token_weight = t_local / t_global if t_global else 0.0
        self.any_token = bool(t_global)
        self.optimizer, self.grpo = GradientSync(optimizer, model.parameters(), ctx, g.max_grad_norm), local_grpo(g)
        optimizer.zero_grad(set_to_none=True)
        self.optimizer.begin(self.loss_weight)

    def finish(self, stats: dict[str, float]) -> dict[str, float]:
        if not self.ctx.enabled:
            return stats
        stats.update(self.optimizer.commit())
        stats = reduce_stats(stats, self.loss_weight, self.token_weight, self.ctx)
        if not self.any_token:  # nothing trained anywhere: the ratio is 1 by convention, as in one process
            stats[M.LOSS_RATIO_MEAN] = 1.0
        return stats


def gather_telemetry(sink: list, n_local: int, ctx: DistContext) -> list:
    """`grpo_update`'s telemetry rows (row index, token ids, log-probs, reference log-probs,
    entropies) of the step's sampled rows only, not gold ones (indices < n_local), numbered as
    one process numbers them: every rank's, in row order. Shards are equal, so rank r's rows
    start at r·n_local."""
    mine = [x for x in sink if x[0] < n_local]
    if not ctx.enabled:
        return mine
    parts = gather_objects(mine, ctx)
    return [(i + r * n_local, ids, lp, rp, en) for r, part in enumerate(parts) for i, ids, lp, rp, en in part]


def sharded_sft_step(step: Callable[[Any, list, float], dict[str, float]], model: torch.nn.Module, optimizer, batch: list, ctx: DistContext,
                     max_grad_norm: float) -> dict[str, float]:
    """One SFT step, `step(optimizer, examples, max_grad_norm)` (keel.train.sft_step), on `batch`.
    Under several processes each rank takes a contiguous slice of `batch` and runs `step` on it
    through a `GradientSync` weighted by its share of the batch's target tokens; the loss is the
    global token mean. Worked example: 5 examples on 2 ranks → rank 0 takes 3, rank 1 takes 2."""
    if not ctx.enabled:
        return step(optimizer, batch, max_grad_norm)
    per = -(-len(batch) // ctx.world_size)
    mine = batch[ctx.rank * per : (ctx.rank + 1) * per]
    n_local = sum(sum(e.targets[1:]) for e in mine)
    n_global = all_reduce_sum([n_local], ctx)[0]
    weight = n_local / n_global if n_global else 0.0
    sync = GradientSync(optimizer, model.parameters(), ctx, max_grad_norm)
    optimizer.zero_grad(set_to_none=True)
    sync.begin(weight)
    stats = step(sync, mine, math.inf)
    stats.update(sync.commit())
    stats[M.LOSS_SFT] = all_reduce_sum([stats[M.LOSS_SFT] * weight], ctx)[0]
    stats[M.SIGNAL_SFT_EXAMPLES] = float(len(batch))
    return stats
