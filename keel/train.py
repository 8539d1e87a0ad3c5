"""The training loop, top to bottom: optional SFT warm-start, then GRPO with evaluation.

    eval (untrained) → SFT on gold trajectories (paper A's single-step decomposition)
    → eval → reference := policy → repeat: rollout groups (+ hints, expert members) → rewards
    → group advantages → clipped surrogate + KL (+ synchronous supervision losses) → update
    → telemetry → detectors → [eval, peak checkpoint] → [interleaved supervision phase] → latest

Supervision signals (keel/signals) change which data enters which loss at which step; they
do not change this structure. Where this departs from the papers: the KL reference is the
policy right after the SFT warm-start (paper A's SFT→GRPO starts from the SFT model); there is
one optimizer step per rollout batch, so the importance ratio is 1 at the step and the PPO clip
never binds (old log-probs are the sampling log-probs, which tests check equal a recomputation;
with a bf16 sampler or autocast they are the fp32 policy's own); groups whose rewards are all
equal are skipped when `grpo.skip_zero_advantage` (their policy-gradient term is exactly zero).
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from keel import checkpoint
from keel import metrics as M
from keel.config import Config, GRPOConfig, dump_yaml, get_key
from keel.diagnostics.step_metrics import PieceCache, rl_step_metrics
from keel.distributed import (DistContext, GradientSync, all_reduce_sum, barrier, broadcast_object, gather_objects, init_distributed,
                              local_config, loss_normaliser, reduce_stats, row_seed, shard_groups)
from keel.errors import UserError
from keel.evaluate import evaluate_model
from keel.logprobs import collate, kept_positions, micro_batches, token_logprobs, update_prefix
from keel.losses import aggregate, batch_advantages, batch_stats, clipped_surrogate, group_advantages, kl_estimate
from keel.memory import release_free_memory, set_mmap_threshold
from keel.models import DTYPES, LoRA, copy_weights, frozen_copy, load_model, make_optimizer, resolve_device
from keel.rollout import SamplingParams, rollout
from keel.rundir import RunDirError, append_jsonl, atomic_write_json, atomic_write_text, write_jsonl
from keel.sft import SFTExample, decompose, gold_trajectory
from keel.signals.schedule import supervision_backward
from keel.signals.state import SignalState
from keel.templates import for_run
from keel.types import Source, Trajectory


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------
def _autocast(enabled: bool, model):
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)


def _reference(ref_model, model):
    """(network that computes the KL reference's log-probs, factory of the context it runs in).
    With LoRA the reference is the policy itself with its adapters switched off; a frozen copy
    runs as it is; None: no reference (network None)."""
    if isinstance(ref_model, LoRA):
        return model, ref_model.reference
    return ref_model, contextlib.nullcontext


def sft_step(model, optimizer, examples: list[SFTExample], pad_id: int, max_grad_norm: float, micro: int = 8, autocast: bool = False,
             max_tokens: int = 0) -> dict[str, float]:
    """One optimizer step of NLL on the examples' target tokens (token-mean over the batch).
    Micro-batches: at most `micro` examples and `max_tokens` encoded positions (`micro_batches`)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = supervision_backward(model, examples, pad_id, 1.0, micro, autocast, max_tokens)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    skipped = not math.isfinite(total) or not torch.isfinite(norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return {M.LOSS_SFT: total, M.LOSS_GRAD_NORM: float(norm), M.LOSS_SKIPPED: float(skipped), M.SIGNAL_SFT_EXAMPLES: float(len(examples))}


# ---------------------------------------------------------------------------------------------
# GRPO update
# ---------------------------------------------------------------------------------------------
def grpo_update(
    model,
    ref_model,
    optimizer,
    trajectories: list[Trajectory],
    advantages: torch.Tensor,
    g: GRPOConfig,
    pad_id: int,
    temperature: float,
    telemetry_sink: list | None = None,
    old_from_policy: Sequence[bool] | None = None,
    extra_losses: list[tuple[str, float, list]] = (),
    autocast: bool = False,
    max_tokens: int = 0,
) -> dict[str, float]:
    """One optimizer step of the GRPO loss over the trajectories (gradient-accumulated).

    Loss = aggregate(clipped surrogate) + g.kl_coef · aggregate(KL(policy || reference)), both
    aggregated over policy (and expert) tokens with the batch-global normalisers, so micro-batch
    size does not change the loss. Returns loss/kl/clip statistics; kl/ and tokens/entropy here
    are over every trained token (the metrics line takes those from the token telemetry).
    A token's "old" log-prob is its sampling one, except where it is this policy's own, taken
    before the update (ratio 1 at this step): expert tokens (off-policy gold, never sampled), and
    every token of trajectory i when `old_from_policy[i]` (None: no trajectory) — the caller
    marks rows sampled by a lower-precision copy of the weights or under autocast, and hinted
    rows (keel.signals.hints) whose sampling log-probs were taken with the hint in context.
    `extra_losses`: (kind, weight, SFT examples) added to this same update — paper A's
    synchronous paradigm (gold SFT, ETS, reflection losses mixed into the RL step).
    `autocast`: bf16 autocast for the forwards; `max_tokens`: cap on the positions one forward
    encodes (`micro_batches`; 0: g.micro_batch_size rows only).
    """
    train_sources = (Source.POLICY, Source.EXPERT)
    members = [i for i in range(len(trajectories)) if not (g.skip_zero_advantage and float(advantages[i]) == 0.0)]
    stats = {M.LOSS_POLICY: 0.0, M.LOSS_KL: 0.0, M.LOSS_TOTAL: 0.0, M.KL_K1_MEAN: 0.0, M.KL_K3_MEAN: 0.0, M.KL_MEAN: 0.0,
             M.LOSS_CLIP_LOW: 0.0, M.LOSS_CLIP_HIGH: 0.0, M.LOSS_RATIO_MEAN: 1.0, M.LOSS_GRAD_NORM: 0.0, M.LOSS_SKIPPED: 0.0,
             M.TOKENS_ENTROPY: 0.0, M.LOSS_TRAINED_MEMBERS: float(len(members))}
    if not members and not extra_losses:
        return stats
    model.train()
    optimizer.zero_grad(set_to_none=True)
    counts = [sum(1 for s in trajectories[i].sources[1:] if s in train_sources) for i in members]
    num_tokens = sum(counts)
    num_seqs = max(len(members), 1)
    sums = {"pg": 0.0, "kl": 0.0, "k1": 0.0, "k3": 0.0, "low": 0.0, "high": 0.0, "ratio": 0.0, "ent": 0.0}
    kept = [[trajectories[i].token_ids[k] for k in kept_positions(trajectories[i].sources)] for i in members]
    parts = micro_batches(kept, g.micro_batch_size, max_tokens)
    ref_net, ref_mode = _reference(ref_model, model)
    ref_prefix = None
    with _autocast(autocast, model):
        prefix = update_prefix(model, kept, parts)
        if ref_net is not None:  # the reference's own encoding of the same prefix, also once per update
            with torch.no_grad(), ref_mode():
                ref_prefix = update_prefix(ref_net, kept, parts)
    for part in parts:
        idx = [members[j] for j in part]
        batch = collate([trajectories[i] for i in idx], sources=train_sources, pad_id=pad_id, advantages=[float(advantages[i]) for i in idx])
        with _autocast(autocast, model):
            logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask, temperature, with_entropy=True,
                                       prefix=prefix)
        if ref_net is None:
            ref_logp = logp.detach()
        else:
            with torch.no_grad(), ref_mode(), _autocast(autocast, model):
                ref_logp, _ = token_logprobs(ref_net, batch.input_ids, batch.attention_mask, batch.target_mask, temperature, prefix=ref_prefix)
        # Expert tokens (off-policy supervision) were not sampled, and the caller's rows were
        # sampled by other weights or context: their "old" log-prob is the current policy's,
        # taken before the update (ratio 1 at this step, as in paper A).
        rows_from_policy = torch.tensor([old_from_policy is not None and bool(old_from_policy[i]) for i in idx])  # [B]
        from_policy = (batch.sources == Source.EXPERT) | rows_from_policy[:, None]  # [B, T]
        old = torch.where(from_policy[batch.target_mask], logp.detach(), batch.old_logprobs[batch.target_mask])
        adv = batch.advantages[batch.target_mask]
        seq_index = batch.target_mask.nonzero()[:, 0]
        lengths = batch.target_mask.sum(1).float()
        pg, low, high = clipped_surrogate(logp, old, adv, g.clip_low, g.clip_high)
        kl = kl_estimate(logp, ref_logp, g.kl_estimator)
        pg_loss = aggregate(pg, seq_index, g.loss_aggregation, num_tokens, num_seqs, lengths)
        kl_loss = aggregate(kl, seq_index, g.loss_aggregation, num_tokens, num_seqs, lengths)
        loss = pg_loss + g.kl_coef * kl_loss
        loss.backward()
        with torch.no_grad():
            sums["pg"] += float(pg_loss)
            sums["kl"] += float(kl_loss)
            sums["k1"] += float(kl_estimate(logp, ref_logp, "k1").sum())
            k3 = kl_estimate(logp, ref_logp, "k3")
            sums["k3"] += float(k3.sum())
            sums["low"] += float(low.sum())
            sums["high"] += float(high.sum())
            sums["ratio"] += float(torch.exp(logp - old).sum())
            sums["ent"] += float(ent.sum())
            if telemetry_sink is not None:
                off = 0
                for b, i in enumerate(idx):
                    n = int(batch.target_mask[b].sum())
                    telemetry_sink.append((i, batch.input_ids[b][batch.target_mask[b]].tolist(), logp[off : off + n].detach(), ref_logp[off : off + n].detach(), ent[off : off + n]))
                    off += n
    if prefix is not None:
        prefix.backward()
    extra_total = 0.0
    if extra_losses:
        for kind, weight, examples in extra_losses:
            if not examples:
                continue
            value = supervision_backward(model, examples, pad_id, weight, g.micro_batch_size, autocast, max_tokens)
            stats[{"sft": M.LOSS_SFT, "ets": M.LOSS_ETS, "reflection": M.LOSS_REFLECTION}[kind]] = value
            extra_total += weight * value
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), g.max_grad_norm)
    total = sums["pg"] + g.kl_coef * sums["kl"] + extra_total
    skipped = not (math.isfinite(total) and torch.isfinite(norm))
    if skipped:  # a NaN/inf must not poison the weights: skip the update, log it, keep going
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    n = max(num_tokens, 1)
    stats.update({M.LOSS_TRAINED_MEMBERS: float(len(members)),
        M.LOSS_POLICY: sums["pg"], M.LOSS_KL: sums["kl"], M.LOSS_TOTAL: total,
        M.KL_K1_MEAN: sums["k1"] / n, M.KL_K3_MEAN: sums["k3"] / n, M.KL_MEAN: sums["k3"] / n,
        M.LOSS_CLIP_LOW: sums["low"] / n, M.LOSS_CLIP_HIGH: sums["high"] / n, M.LOSS_RATIO_MEAN: sums["ratio"] / n,
        M.LOSS_GRAD_NORM: float(norm), M.LOSS_SKIPPED: float(skipped), M.TOKENS_ENTROPY: sums["ent"] / n,
    })
    return stats


def advantages(rewards: torch.Tensor, groups: list[int], g, ctx) -> torch.Tensor:
    """This rank's advantages under `grpo.baseline`: centred on each group's mean (GRPO), or on
    the mean of the whole step's batch over every rank (`batch`, one all-reduce)."""
    if g.baseline == "batch":
        total, total_sq, n = all_reduce_sum([float(rewards.sum()), float((rewards.float() ** 2).sum()), float(len(rewards))], ctx)
        return batch_advantages(rewards, *batch_stats(total, total_sq, n), g.scale_by_std)
    return group_advantages(rewards, torch.tensor(groups, dtype=torch.long), g.scale_by_std)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
class Interrupted:
    """SIGINT or SIGTERM (`kill`, `docker stop`, a scheduler's pre-emption) sets the flag; the
    loop finishes its step, checkpoints, writes summary.json and returns; the CLI then exits
    with 128 + the signal's number (130, 143). A second signal aborts at once (`Aborted`)."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self):
        self.flag = False
        self.signal_name: str | None = None  # which signal set the flag
        self._old: dict[int, Any] = {}

    def __enter__(self):
        import signal

        from keel.errors import Aborted

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.flag:  # a second signal aborts at once
                raise Aborted(signum)
            self.flag, self.signal_name = True, name
            print(f"\n[keel] {name}: finishing this step, then checkpointing (send it again to abort)", flush=True)

        for name in self.SIGNALS:
            num = getattr(signal, name)
            try:
                self._old[num] = signal.signal(num, handler)
            except ValueError:  # not in the main thread
                pass
        return self

    def __exit__(self, *exc):
        import signal

        for num, old in self._old.items():
            signal.signal(num, old)
        self._old = {}
        return False


def _on_main(fn, ctx: DistContext):
    """fn() on rank 0; a UserError it raises is raised on every rank (none waits forever)."""
    problem = None
    if ctx.is_main:
        try:
            fn()
        except UserError as e:
            problem = e
    problem = broadcast_object(problem, ctx) if ctx.enabled else problem
    if problem is not None:
        raise problem


def train(cfg: Config, out_dir: Path, resume: bool = False, ctx: DistContext | None = None, lock=None, prepared=None) -> dict[str, Any]:
    """Run the whole job into the new directory `out_dir` (or continue it with `resume`);
    returns summary.json's content. Under `torchrun` / `accelerate launch` every process calls
    this with the same arguments (see keel.distributed): rank 0 writes the run directory.
    `lock`: the caller's keel.rundir.RunDirLock on `out_dir` (else, in one process, this call
    takes one for the run and, if the run fails before logging a step, deletes what it created). `prepared`:
    (env, train tasks, dev tasks) the caller already loaded (else keel.tasks.prepare)."""
    from keel.config import to_dict
    from keel.rewards import resolve_reward
    from keel.rundir import claim_run_dir, lock_run_dir, usable_checkpoint
    from keel.trackers import make_tracker

    ctx = ctx if ctx is not None else init_distributed()
    out_dir = Path(out_dir)
    if ctx.enabled:
        check_distributed_config(cfg, ctx)
    reward_fn = resolve_reward(cfg.reward.name)  # a key of REWARDS or the user's module:function
    if resume and not (out_dir / "config.yaml").exists():
        raise RunDirError(f"--resume {out_dir}: no config.yaml (not a Keel run directory)")
    run, own = out_dir, []
    if lock is None and not ctx.enabled:  # one process owns the directory for the whole run (under torchrun: the CLI's rank 0)
        own.append(lock_run_dir(run) if resume else claim_run_dir(run))
    try:
        if resume:
            def check_and_record():
                usable_checkpoint(run / "checkpoints" / "latest")  # corrupt latest: fall back to .old, or say what to do
                text = dump_yaml(cfg)
                if (run / "config.yaml").read_text(encoding="utf-8") != text:  # --set on resume is part of the run from now on
                    atomic_write_text(run / "config.yaml", text)
            _on_main(check_and_record, ctx)
        else:
            if ctx.is_main:
                atomic_write_text(run / "config.yaml", dump_yaml(cfg))
            barrier(ctx)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if cfg.run.malloc_mmap_threshold_mb:
            if not set_mmap_threshold(cfg.run.malloc_mmap_threshold_mb) and ctx.is_main:
                print("[keel] warning: run.malloc_mmap_threshold_mb has no effect here (no glibc mallopt)", flush=True)
        if not cfg.run.progress:  # transformers' own bars ("Writing model shards") follow run.progress too
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        # fails here, before training, if a package is missing; other ranks log nothing
        tracker = make_tracker(cfg.report_to if ctx.is_main else [], run, config=to_dict(cfg), run_name=run.name)
        try:
            with Interrupted() as interrupted:
                trainer = Trainer(cfg, run, reward_fn, tracker, interrupted, ctx, prepared)
                try:
                    return trainer.run(resume)
                finally:
                    close_env = getattr(trainer.env, "close", None)  # e.g. stop an MCP tool server
                    if callable(close_env):
                        close_env()
        finally:
            tracker.close()
    except BaseException:
        if own and not resume:
            own[0].discard_if_fresh()
        raise
    finally:
        if own:
            own[0].release()


def check_distributed_config(cfg: Config, ctx: DistContext) -> None:
    """What runs data-parallel: SFT, GRPO (groups sharded), OPS, hints, ETS and interleaved
    supervision phases (the latter repeated identically on every rank). PRS and synchronous
    supervision losses normalise by local counts inside the update and are refused."""
    if cfg.signals.reflection.enabled:
        raise UserError(f"distributed: signals.reflection (PRS) runs in one process only; {ctx.world_size} processes were started")
    from keel.signals.schedule import Schedule

    schedule = Schedule.from_config(cfg.signals, cfg.grpo.lr)
    if any(schedule.sync_weight(k) > 0 for k in schedule.kinds):
        raise UserError("distributed: synchronous supervision losses (signals.paradigm=synchronous) run in one process only")
    shard_groups(cfg.rollout.prompts_per_step, ctx)  # prompts_per_step must divide evenly


class Trainer:
    """Holds the run's objects; `run()` is the loop, top to bottom. Not a base class: a
    supervision signal changes what goes into the losses, not this structure."""

    def __init__(self, cfg: Config, run: Path, reward_fn, tracker, interrupted: Interrupted, ctx: DistContext | None = None, prepared=None):
        from keel import tasks as task_builder
        from keel.diagnostics.detectors import Detectors
        from keel.diagnostics.telemetry import ControlFrequencyBaseline

        self.cfg, self.run_dir, self.reward_fn, self.tracker, self.interrupted = cfg, run, reward_fn, tracker, interrupted
        self.ctx = ctx if ctx is not None else DistContext()
        self.t_start = time.time()
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        self.rng = random.Random(cfg.run.seed)  # the same on every rank: ranks agree on batches and phases
        device = resolve_device(cfg.model.device)
        self.model, self.tok = load_model(cfg.model.name, cfg.model.dtype, cfg.run.seed, device, own_template=cfg.model.chat_format == "template")
        self.chat = for_run(cfg, self.tok)  # None: Keel's Hermes layout; else the model's own template renders every episode
        self.lora = None
        if cfg.model.lora_rank > 0:
            self.lora = LoRA(self.model, cfg.model.lora_rank, cfg.model.lora_alpha)
            self.model = self.lora.model
        if cfg.model.gradient_checkpointing:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        for main_turn in (True, False):  # rank 0 writes run/data (synthetic data) before the others read it
            if self.ctx.is_main == main_turn:
                self.env, self.train_tasks, dev_tasks = prepared or task_builder.prepare(cfg, run, self.tok, self.chat)
            barrier(self.ctx)
        self.dev = dev_tasks[: cfg.eval.n_dev]
        self.tasks_by_id = {t.id: t for t in self.train_tasks + self.dev}
        self.pad_id = self.tok.pad_token_id
        self.pieces = PieceCache(self.tok)
        self.detectors = Detectors(cfg.detectors)
        self.freq_baseline = ControlFrequencyBaseline()
        self.p = checkpoint.Progress(summary={"run_dir": str(run), "model": cfg.model.name, "n_train": len(self.train_tasks), "n_dev_eval": len(self.dev)})
        self.sampler = self.model
        if cfg.rollout.dtype != cfg.model.dtype:
            self.sampler = frozen_copy(self.model, DTYPES[cfg.rollout.dtype])
        self.ref_model = None
        self.opt = None
        self.sched = None
        self.signals = SignalState(cfg.signals, cfg.grpo.lr, self.env, self.tok, self.train_tasks, self.tasks_by_id, cfg.sft.packed)

    # ---- small services -------------------------------------------------------------------
    def log(self, line: dict[str, Any]) -> None:
        line = {M.STEP: self.p.step, **line, M.TIME_WALL: time.time() - self.t_start, M.MEM_PEAK_RSS: _peak_rss_mb()}
        release_free_memory()  # a line ends a step or an evaluation: hand that phase's freed heap back
        self.p.metrics_lines += 1
        if not self.ctx.is_main:
            return
        append_jsonl(self.run_dir / "metrics.jsonl", line)
        self.tracker.log(self.p.step, {k: v for k, v in line.items() if isinstance(v, (int, float)) and k != M.STEP})

    def refresh_report(self) -> None:
        if not self.ctx.is_main:
            return
        try:  # the report is a view; failing to draw it must not stop training
            from keel.report import write_report

            write_report(self.run_dir)
        except Exception as exc:
            print(f"[keel] warning: report not written: {type(exc).__name__}: {exc}", flush=True)

    def make_reference(self) -> None:
        """The frozen reference: the policy as RL starts. Kept even at kl_coef 0, because the
        per-token KL telemetry (which tokens drift) reads it."""
        if self.lora is not None:  # the SFT model = adapters off after folding: no copy
            self.lora.fold()
            self.ref_model = self.lora
            return
        self.ref_model = frozen_copy(self.model)

    def evaluate(self, label: str) -> dict[str, float]:
        """Greedy dev evaluation. Under several processes each rank takes a contiguous shard of
        the dev set and the records are gathered (in rank order = dev order) before the means."""
        cfg, ctx = self.cfg, self.ctx
        params = SamplingParams(temperature=1.0, greedy=True, max_turns=cfg.rollout.max_turns,
                                max_new_tokens=cfg.eval.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
        per = -(-len(self.dev) // ctx.world_size)
        mine = self.dev[ctx.rank * per : (ctx.rank + 1) * per]
        bar = _progress(len(mine), f"eval ({label})", cfg.run.progress and ctx.is_main)
        means, rows, trajs = evaluate_model(self.sampler, self.tok, self.env, mine, params, cfg.eval.batch_size, progress=bar.update, chat=self.chat)
        bar.close()
        if ctx.enabled:
            from keel.diagnostics.episode_metrics import eval_metrics

            rows = [r for part in gather_objects(rows, ctx) for r in part]
            trajs = [t for part in gather_objects(trajs[: cfg.eval.samples], ctx) for t in part]
            means = eval_metrics(rows)
        step = self.p.step
        if ctx.is_main:
            write_jsonl(self.run_dir / "eval" / f"step_{step:06d}.jsonl", [{**r, "label": label} for r in rows])
            write_jsonl(self.run_dir / "samples" / f"step_{step:06d}.jsonl",
                        [{**tr.to_dict(), "pieces": self.pieces(tr.token_ids), "question": self.tasks_by_id[tr.task_id].question, "label": label}
                         for tr in trajs[: cfg.eval.samples]])
        if cfg.eval.tool_lift_n > 0:  # on every rank alike (same weights, same generator): same numbers
            from keel.evaluate import tool_lift_metrics

            sampled = SamplingParams(temperature=cfg.rollout.temperature, max_turns=cfg.rollout.max_turns,
                                     max_new_tokens=cfg.eval.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
            # its own seeded generator: tool lift must not shift the training rollouts' randomness
            lift_gen = torch.Generator().manual_seed(cfg.run.seed * 1000003 + step)
            means.update(tool_lift_metrics(self.sampler, self.tok, self.env, self.dev[: cfg.eval.tool_lift_n], sampled,
                                           cfg.eval.tool_lift_k, lift_gen, cfg.eval.batch_size, chat=self.chat))
        self.say(f"[keel] step {step} eval ({label}): EM {means[M.EVAL_EM]:.3f}  F1 {means[M.EVAL_F1]:.3f}  "
                 f"format-valid {means[M.EVAL_FORMAT_VALID]:.3f}  tools/q {means[M.EVAL_TOOLS_PER_QUESTION]:.2f}")
        return means

    def say(self, message: str) -> None:
        if self.ctx.is_main:
            print(message, flush=True)

    def interrupted_anywhere(self) -> bool:
        """SIGINT reaches each rank at its own moment: the ranks agree (any of them) at step ends,
        so all checkpoint and stop at the same step instead of waiting on each other forever."""
        if not self.ctx.enabled:
            return self.interrupted.flag
        self.interrupted.flag = all_reduce_sum([float(self.interrupted.flag)], self.ctx)[0] > 0
        return self.interrupted.flag

    def next_batch(self, order: list[int], n: int, pool: int) -> list[int]:
        """n indices from a shuffled epoch order, reshuffling when an epoch ends (order is Progress state)."""
        out = []
        while len(out) < n:
            if not order:
                order.extend(range(pool))
                self.rng.shuffle(order)
            out.append(order.pop())
        return out

    # ---- the loop -------------------------------------------------------------------------
    def run(self, resume: bool) -> dict[str, Any]:
        cfg, p = self.cfg, self.p
        has_checkpoint = checkpoint.complete_checkpoint(self.run_dir / "checkpoints" / "latest") is not None if self.ctx.is_main else None
        if resume and broadcast_object(has_checkpoint, self.ctx):  # rank 0 decides (and mends a half-swapped one)
            checkpoint.restore(self)
            p = self.p
            self.say(f"[keel] resumed {self.run_dir} at step {p.step} ({p.phase})")
        elif resume:  # killed before its first checkpoint was complete: start over in the same directory
            checkpoint.restart(self.run_dir, self.ctx)
            self.say(f"[keel] {self.run_dir} has no complete checkpoint yet: starting it again from step 0")
        # 1. the untrained model
        if p.phase == "start":
            if cfg.eval.before_sft:
                means = self.evaluate("before_sft")
                p.summary["eval_before_sft"] = means
                self.log({M.PHASE: "eval", **means})
            p.phase = "sft"
            self.opt, self.sched = make_optimizer(self.model, cfg.sft.lr, cfg.sft.warmup_steps, 0.0, cfg.grpo.adam_eps)
        # 2. SFT warm-start on gold trajectories (paper A's single-step decomposition)
        if p.phase == "sft":
            if cfg.sft.enabled and cfg.sft.steps > 0 and not self.sft_phase():
                return self.finish(interrupted=True)
            if cfg.sft.enabled and cfg.sft.steps > 0:
                self.opt = self.sched = None  # SFT's AdamW state (2× the weights) is not needed by the eval; RL makes its own
                copy_weights(self.sampler, self.model)
                means = self.evaluate("after_sft")
                p.summary["eval_after_sft"] = means
                p.summary["eval_after_sft_step"] = p.step
                self.log({M.PHASE: "eval", **means})
            p.phase = "rl"
            self.make_reference()
            if cfg.run.save_checkpoints:
                checkpoint.save(self, "reference", self.model if self.lora is not None else self.ref_model, None, {"step": p.step})
            self.opt, self.sched = make_optimizer(self.model, cfg.grpo.lr, cfg.grpo.warmup_steps, cfg.grpo.weight_decay, cfg.grpo.adam_eps)
            checkpoint.save_latest(self)
            if self.interrupted_anywhere():  # a signal during the post-SFT eval: stop here, not after a whole RL step
                return self.finish(interrupted=True)
        # 3. GRPO
        if p.phase == "rl":
            if not self.rl_phase():
                return self.finish(interrupted=True)
            p.phase = "done"
        return self.finish()

    def sft_phase(self) -> bool:
        """SFT steps until sft.steps are done; False if interrupted (checkpointed)."""
        cfg, p = self.cfg, self.p
        if cfg.signals.self_distill.trajectories:
            # paper B rung 7 (ReST-EM): SFT from the base on a checkpoint's own kept episodes
            from keel.signals.restem import read_trajectories, self_distillation_examples

            path = Path(cfg.signals.self_distill.trajectories)
            if not path.exists():
                raise FileNotFoundError(f"signals.self_distill.trajectories: file not found: {path} (make it with `keel distill`)")
            examples = self_distillation_examples(read_trajectories(path), packed=cfg.sft.packed)
            if not examples:
                raise UserError(f"signals.self_distill.trajectories: {path} has no usable episodes")
            p.summary["sft_source"] = f"self-distillation: {path}"
        else:
            golds = [gold_trajectory(self.tok, self.env, t, chat=self.chat) for t in self.train_tasks]
            examples = [e for g in golds if g.info.get("gold_ok", True) for e in decompose(g, packed=cfg.sft.packed)]
            if not examples:
                raise UserError("sft: no gold trajectory could be replayed in the environment (every gold call failed)")
            p.summary["sft_gold_failed"] = sum(1 for g in golds if not g.info.get("gold_ok", True))
        p.summary["sft_examples"] = len(examples)
        bar = _progress(cfg.sft.steps, "sft", cfg.run.progress and self.ctx.is_main)
        bar.update(p.sft_done)
        while p.sft_done < cfg.sft.steps:
            p.step += 1
            batch = [examples[i] for i in self.next_batch(p.sft_order, cfg.sft.batch_size, len(examples))]
            t0 = time.time()
            stats = self.sft_update(batch)
            self.sched.step()
            self.model.zero_grad(set_to_none=True)  # no gradient lives between steps (~0.5 GB for SmolLM2)
            p.sft_done += 1
            self.log({M.PHASE: "sft", **stats, M.OPTIM_LR: self.sched.get_last_lr()[0], M.TIME_UPDATE: time.time() - t0})
            bar.set_postfix(loss=f"{stats[M.LOSS_SFT]:.3f}")
            bar.update(1)
            interrupted = self.interrupted_anywhere()
            if cfg.run.checkpoint_every and p.sft_done % cfg.run.checkpoint_every == 0 or interrupted:
                checkpoint.save_latest(self)
            if interrupted:
                bar.close()
                return False
        bar.close()
        return True

    def sft_update(self, batch: list[SFTExample]) -> dict[str, float]:
        """One SFT step on `batch`; under several processes each rank takes a contiguous slice
        and the gradients are combined with token weights (keel.distributed.GradientSync)."""
        cfg, ctx = self.cfg, self.ctx
        if not ctx.enabled:
            return sft_step(self.model, self.opt, batch, self.pad_id, cfg.grpo.max_grad_norm, autocast=cfg.model.autocast,
                            max_tokens=cfg.model.max_tokens_per_micro_batch)
        per = -(-len(batch) // ctx.world_size)
        mine = batch[ctx.rank * per : (ctx.rank + 1) * per]
        n_local = sum(sum(e.targets[1:]) for e in mine)
        n_global = all_reduce_sum([n_local], ctx)[0]
        weight = n_local / n_global if n_global else 0.0
        sync = GradientSync(self.opt, self.model.parameters(), ctx, cfg.grpo.max_grad_norm)
        self.opt.zero_grad(set_to_none=True)
        sync.begin(weight)
        stats = sft_step(self.model, sync, mine, self.pad_id, math.inf, autocast=cfg.model.autocast, max_tokens=cfg.model.max_tokens_per_micro_batch)
        stats.update(sync.commit())
        stats[M.LOSS_SFT] = all_reduce_sum([stats[M.LOSS_SFT] * weight], ctx)[0]
        stats[M.SIGNAL_SFT_EXAMPLES] = float(len(batch))
        return stats

    def rl_phase(self) -> bool:
        """GRPO steps until grpo.steps are done, a stop alert fires, or an interrupt."""
        cfg, p = self.cfg, self.p
        params = SamplingParams(temperature=cfg.rollout.temperature, max_turns=cfg.rollout.max_turns,
                                max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
        bar = _progress(cfg.grpo.steps, "grpo", cfg.run.progress and self.ctx.is_main)
        bar.update(p.rl_done)
        while p.rl_done < cfg.grpo.steps:
            p.step += 1
            p.rl_done += 1
            line, stop = self.rl_step(params)
            phase = self.signals.schedule.phase_after(p.rl_done)
            if phase is not None and not stop:
                self.supervision_phase(phase)  # every rank alike: same examples, same rng, same weights
            last = p.rl_done == cfg.grpo.steps
            interrupted = self.interrupted_anywhere()
            if cfg.run.save_checkpoints and (line.get(M.EVAL_EM) is not None or stop or interrupted or last
                                             or (cfg.run.checkpoint_every and p.rl_done % cfg.run.checkpoint_every == 0)):
                checkpoint.save_latest(self)
            if line.get(M.EVAL_EM) is not None:
                self.refresh_report()
            bar.set_postfix(reward=f"{line[M.REWARD_MEAN]:.3f}", em=f"{p.last_eval[M.EVAL_EM]:.2f}" if p.last_eval else "-")
            bar.update(1)
            if stop:
                p.summary["stopped_by_alert"] = {"step": p.step}
                break
            if interrupted:
                bar.close()
                return False
        bar.close()
        return True

    def supervision_phase(self, phase) -> None:
        """Paper A's interleaved paradigm: `epochs` of supervision (own optimizer and lr) between
        RL steps; each supervision step is one metrics line with phase "sft"."""
        from keel.signals.schedule import run_phase

        examples = [e for k in phase.sources for e in self.signals.supervision_pool(k)]
        if not examples:
            return
        opt = torch.optim.AdamW(self.model.parameters(), lr=phase.lr, weight_decay=0.0, eps=self.cfg.grpo.adam_eps)
        lines = run_phase(self.model, examples, phase, self.pad_id, self.cfg.grpo.max_grad_norm, self.rng,
                          self.cfg.grpo.micro_batch_size, optimizer=opt, autocast=self.cfg.model.autocast,
                          max_tokens=self.cfg.model.max_tokens_per_micro_batch)
        for stats in lines:
            self.p.step += 1
            self.log({M.PHASE: "sft", **stats, M.SIGNAL_PHASE: phase.kind})
        copy_weights(self.sampler, self.model)

    def rl_step(self, params: SamplingParams) -> tuple[dict[str, Any], bool]:
        """One GRPO step: rollout → rewards → advantages → update → telemetry → detectors.

        Under several processes each rank rolls out and trains on a contiguous block of the
        step's groups (a group never spans ranks, so advantages stay exact), the gradients are
        combined with token weights, and the trajectories are gathered so every rank computes
        the same metrics line and the detectors take the same decisions.
        """
        from keel.signals.hints import is_hinted
        from keel.signals.ops import expert_members, group_with_experts, sampled_rows
        from keel.signals.reflection import collect_reflections, reflection_example
        from keel.signals.schedule import sample_examples

        cfg, p, ctx = self.cfg, self.p, self.ctx
        t0 = time.time()
        s = cfg.signals
        signal_line: dict[str, Any] = {}
        batch_tasks = [self.train_tasks[i] for i in self.next_batch(p.rl_order, cfg.rollout.prompts_per_step, len(self.train_tasks))]
        # OPS "replace" (the authors' replace_num=1): the gold trajectory takes one slot of each group
        n_replace = s.ops.members if s.ops.enabled and s.ops.mode == "replace" else 0
        rows, groups = sampled_rows(batch_tasks, cfg.rollout.group_size, n_replace)
        mine = shard_groups(len(batch_tasks), ctx)
        keep = [i for i, g in enumerate(groups) if g in mine]
        local_rows, local_groups = [rows[i] for i in keep], [groups[i] for i in keep]
        # one generator per row, seeded by (seed, step, group, member): what a row samples does
        # not depend on the rank or the batch it is in
        gens = [torch.Generator().manual_seed(row_seed(cfg.run.seed, p.rl_done, g, i - groups.index(g))) for i, g in zip(keep, local_groups)]
        hints = None
        if self.signals.hint_policy is not None:  # shown only while sampling; collate drops them for the loss
            per_task = self.signals.hint_policy.hints_for(batch_tasks)
            hints = [per_task[g] for g in local_groups]
            signal_line[M.SIGNAL_HINTED_GROUPS] = sum(h is not None for h in per_task) / len(per_task)
        local = rollout(self.sampler, self.tok, self.env, local_rows, params, generator=gens, groups=local_groups, hints=hints,
                        hint_position=s.hint.position, chat=self.chat)
        t_rollout = time.time() - t0
        release_free_memory()  # the rollout's KV caches were freed into the heap; the update allocates differently
        for tr, task in zip(local, local_rows):
            try:
                total, parts = self.reward_fn(tr, task)
            except Exception as exc:  # one odd sample must not crash a long run
                total, parts = 0.0, {"reward_error": 1.0}
                tr.info["reward_error"] = f"{type(exc).__name__}: {exc}"
            tr.reward, tr.reward_components = float(total), parts
        trajs = [t for part in gather_objects(local, ctx) for t in part] if ctx.enabled else local  # all rows, in row order
        group_rewards = [[tr.reward for tr, g in zip(trajs, groups) if g == k] for k in range(len(batch_tasks))]
        task_ids = [t.id for t in batch_tasks]
        if self.signals.hint_policy is not None:
            self.signals.hint_policy.observe(task_ids, group_rewards)
        if self.signals.ets is not None:  # ETS: queries whose whole group failed enter the buffer
            self.signals.ets.observe(p.rl_done, task_ids, group_rewards)
            signal_line[M.SIGNAL_ETS_BUFFER] = float(len(self.signals.ets))
        local_rewards = torch.tensor([tr.reward for tr in local])
        members = local
        if s.ops.enabled:  # OPS: gold members join the group; advantages over both kinds (Eq. 4)
            experts = [e for k in mine for e in expert_members(self.tok, self.env, batch_tasks[k], s.ops.members, group=k, cache=self.signals.gold_cache)]
            expert_rewards = [self.reward_fn(e, batch_tasks[e.group])[0] for e in experts]
            mixed_groups = group_with_experts(local, local_rewards, experts, expert_rewards, local_groups, cfg.grpo.scale_by_std)
            members, adv = mixed_groups.trajectories, mixed_groups.advantages
            signal_line[M.SIGNAL_OPS_MEMBERS] = all_reduce_sum([len(experts)], ctx)[0]
        else:
            adv = advantages(local_rewards, local_groups, cfg.grpo, ctx)
        if self.signals.analyzer is not None:  # PRS (one process only): reflections on failed episodes join the pool
            got, errors = collect_reflections(self.signals.analyzer, self.rng.sample(trajs, len(trajs)), self.tasks_by_id,
                                              s.reflection.fail_at, s.reflection.per_step)
            self.signals.add_reflections([reflection_example(self.tok, tr, r.text, s.reflection.max_tokens) for tr, r in got], s.reflection.pool)
            signal_line.update({M.SIGNAL_REFLECTIONS: float(len(got)), M.SIGNAL_REFLECTION_ERRORS: float(errors)})
        extra = [(k, self.signals.schedule.sync_weight(k), sample_examples(self.signals.supervision_pool(k), s.sync_examples, self.rng))
                 for k in self.signals.schedule.kinds if self.signals.schedule.sync_weight(k) > 0]
        t1 = time.time()
        sink: list = []
        # old log-probs from the policy: rows sampled by another copy of the weights (bf16 sampler,
        # autocast), and hinted rows: sampled with the hint in context, trained without it
        # (π(·|no hint), as verl's recomputed old log-probs give)
        other_sampler = self.sampler is not self.model or cfg.model.autocast
        hint_rule = s.hint.enabled and s.hint.recompute_old_logprobs
        old_from_policy = [other_sampler or (hint_rule and is_hinted(tr)) for tr in members]
        update_args = dict(telemetry_sink=sink, old_from_policy=old_from_policy, autocast=cfg.model.autocast,
                           max_tokens=cfg.model.max_tokens_per_micro_batch)
        if ctx.enabled:
            n_local = loss_normaliser(members, adv, cfg.grpo.loss_aggregation, cfg.grpo.skip_zero_advantage)
            t_local = loss_normaliser(members, adv, "token-mean", cfg.grpo.skip_zero_advantage)
            n_global, t_global = all_reduce_sum([n_local, t_local], ctx)
            sync = GradientSync(self.opt, self.model.parameters(), ctx, cfg.grpo.max_grad_norm)
            self.opt.zero_grad(set_to_none=True)
            sync.begin(n_local / n_global if n_global else 0.0)
            stats = grpo_update(self.model, self.ref_model, sync, members, adv, local_config(cfg).grpo, self.pad_id, cfg.rollout.temperature,
                                **update_args)
            stats.update(sync.commit())
            stats = reduce_stats(stats, n_local / n_global if n_global else 0.0, t_local / t_global if t_global else 0.0, ctx)
            if not t_global:  # nothing trained anywhere: the ratio is 1 by convention, as in one process
                stats[M.LOSS_RATIO_MEAN] = 1.0
            # telemetry rows of every rank, numbered as one process numbers them (row order)
            # sampled rows only, not gold ones; shards are equal, so rank r's rows start at r·len(local)
            parts = gather_objects([x for x in sink if x[0] < len(local)], ctx)
            sink = [(i + r * len(local), ids, lp, rp, en) for r, part in enumerate(parts) for i, ids, lp, rp, en in part]
        else:
            stats = grpo_update(self.model, self.ref_model, self.opt, members, adv, cfg.grpo, self.pad_id, cfg.rollout.temperature,
                                extra_losses=extra, **update_args)
            sink = [x for x in sink if x[0] < len(trajs)]  # KL telemetry on sampled tokens, not gold ones
        self.sched.step()
        self.model.zero_grad(set_to_none=True)  # the rollout and evaluations that follow need no gradients
        copy_weights(self.sampler, self.model)
        t_update = time.time() - t1
        # the structural states read <tool_call> blocks: a healthy Llama-3.1 bare-JSON call would count as full collapse
        line = rl_step_metrics(trajs, rows, groups, len(batch_tasks), stats, signal_line, sink, self.pieces, self.freq_baseline,
                               structural=self.chat is None or self.chat.family == "hermes", lr=self.sched.get_last_lr()[0],
                               t_rollout=t_rollout, t_update=t_update)
        if p.rl_done % cfg.eval.every == 0 or p.rl_done == cfg.grpo.steps:
            p.last_eval = self.evaluate(f"rl_step_{p.rl_done}")
            line.update(p.last_eval)
            if p.last_eval[M.EVAL_EM] > p.peak[M.EVAL_EM]:
                p.peak = {"step": p.step, **p.last_eval}
                if cfg.run.save_checkpoints:
                    checkpoint.save(self, "peak", self.model, None, {"step": p.step, "eval": p.last_eval})
        line[M.TIME_STEP] = time.time() - t0
        stop = self.handle_alerts(line)
        self.log(line)
        return line, stop

    def handle_alerts(self, line: dict[str, Any]) -> bool:
        """Run the detectors on this step's line; warn, stop, or roll back to the peak."""
        alerts = self.detectors.update(self.p.step, line)
        stop = False
        for alert in alerts:
            record = alert.to_dict()
            if alert.action == "rollback":
                record["rolled_back_to"] = checkpoint.rollback(self, alert.on_rollback)  # peak weights, new config, new optimizer
                if record["rolled_back_to"] is not None:
                    line[M.ALERT_ROLLBACK] = 1.0
                    record["config_now"] = {k: get_key(self.cfg, k) for k in alert.on_rollback}
                    self.p.config_changes.update(record["config_now"])
            elif alert.action == "stop":
                stop = True
            if self.ctx.is_main:
                append_jsonl(self.run_dir / "alerts.jsonl", record)
            self.p.alerts_lines += 1
            self.say(f"[keel] step {self.p.step} ALERT {alert.kind}: {alert.suggested_action} (action: {alert.action})")
        line[M.ALERT_COUNT] = float(len(alerts))
        return stop

    def finish(self, interrupted: bool = False) -> dict[str, Any]:
        p = self.p
        s = p.summary
        # the final evaluation of a finished run; an interrupted one has none yet (not the pre-SFT one)
        s["eval_final"] = None if interrupted else p.last_eval if p.last_eval is not None else s.get("eval_after_sft") or s.get("eval_before_sft")
        s["peak"] = p.peak if p.peak["step"] is not None else None
        s["steps"] = p.step
        s["grpo_steps_done"] = p.rl_done
        s["phase"] = p.phase
        s["interrupted"] = interrupted
        s["interrupted_by"] = self.interrupted.signal_name if interrupted else None  # SIGINT | SIGTERM
        lift = self.rl_lift() if self.ctx.is_main else None
        if lift is not None:
            s.update(lift)
        s["wall_time_s"] = s.get("wall_time_s", 0.0) + (time.time() - self.t_start)
        if self.ctx.enabled:
            s["processes"] = self.ctx.world_size
        if self.ctx.is_main:
            atomic_write_json(self.run_dir / "summary.json", s)
        self.refresh_report()
        if interrupted:
            self.say(f"[keel] stopped cleanly at step {p.step}; continue with: keel train --resume {self.run_dir}")
        elif lift is not None:
            self.say(f"[keel] RL lifted dev EM {lift[M.RL_LIFT_EM_AFTER_SFT]:.2f} → {lift[M.RL_LIFT_EM_FINAL]:.2f} "
                     f"({lift[M.RL_LIFT_EM]:+.2f}, McNemar p={lift[M.RL_LIFT_P_VALUE]:.3g}, n={lift[M.RL_LIFT_N]}; "
                     f"{lift[M.RL_LIFT_GAINED]} questions gained, {lift[M.RL_LIFT_LOST]} lost)")
        barrier(self.ctx)
        return s

    def rl_lift(self) -> dict[str, Any] | None:
        """What the RL phase did: the final evaluation against the post-SFT one, paired per dev
        question (the final checkpoint, not the peak: no selection on the set reported), with an
        exact McNemar test. None without both evaluations (no SFT, or no RL eval yet)."""
        from keel.compare import paired_lift, read_eval

        after_sft = self.p.summary.get("eval_after_sft_step")
        if after_sft is None or self.p.last_eval is None or self.p.rl_done == 0:
            return None
        final = sorted((self.run_dir / "eval").glob("step_*.jsonl"))[-1]  # zero-padded names: the last is the latest
        try:
            lift = paired_lift(read_eval(self.run_dir / "eval" / f"step_{after_sft:06d}.jsonl"), read_eval(final))
        except (OSError, ValueError) as exc:  # a summary line must not crash the end of a finished run
            self.say(f"[keel] warning: RL lift not computed: {exc}")
            return None
        return {M.RL_LIFT_EM: lift["lift"], M.RL_LIFT_P_VALUE: lift["p_value"], M.RL_LIFT_N: lift["n"], M.RL_LIFT_GAINED: lift["gained"],
                M.RL_LIFT_LOST: lift["lost"], M.RL_LIFT_EM_AFTER_SFT: lift["before"], M.RL_LIFT_EM_FINAL: lift["after"]}
