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

Reading order: `train` (the run directory) → `loop` (the phases) → `sft_phase` / `rl_phase` →
`rl_step` → `grpo_update`. The run's objects are a plain keel.run.Run; checkpoints, resume and
rollback are keel.checkpoint; the metrics line is keel.diagnostics.step_metrics; what changes
under several processes (sharded updates, global advantages and telemetry) is keel.distributed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from keel import checkpoint
from keel import metrics as M
from keel.config import Config, GRPOConfig
from keel.diagnostics.step_metrics import rl_step_metrics
from keel.distributed import (DistContext, ShardedUpdate, gather_objects, gather_telemetry, init_distributed, row_seed,
                              shard_groups, sharded_sft_step)
from keel.logprobs import collate, kept_positions, micro_batches, token_logprobs, training_passes, update_prefix
from keel.losses import aggregate, clipped_surrogate, kl_estimate
from keel.memory import release_free_memory
from keel.models import adamw, copy_weights, make_optimizer, no_autocast, reference_network, release_weights
from keel.rewards import resolve_reward, score
from keel.rollout import SamplingParams, rollout
from keel.run import (Run, check_distributed_config, evaluate, evaluate_rl, finish, handle_alerts, interrupted_anywhere, log, make_reference,
                      next_batch, progress_bar, refresh_report, run_directory, start, warm_start_examples)
from keel.rundir import RunDirError
from keel.sft import SFTExample, supervision_backward
from keel.signals.ops import sampled_rows
from keel.signals.schedule import run_phase, sample_examples
from keel.types import Source, Trajectory, close_env


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------
def sft_step(model, optimizer, examples: list[SFTExample], pad_id: int, max_grad_norm: float, micro: int = 8, autocast: bool = False,
             max_tokens: int = 0, keep_prefix_graph: bool = True) -> dict[str, float]:
    """One optimizer step of NLL on the examples' target tokens (token-mean over the batch).
    Micro-batches: at most `micro` examples and `max_tokens` encoded positions (`micro_batches`);
    `keep_prefix_graph` as `keel.sft.supervision_backward`'s."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = supervision_backward(model, examples, pad_id, 1.0, micro, autocast, max_tokens, keep_prefix_graph)
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
def grpo_update(model, ref_model, optimizer, trajectories: list[Trajectory], advantages: torch.Tensor, g: GRPOConfig, pad_id: int, temperature: float,
                telemetry_sink: list | None = None, old_from_policy: Sequence[bool] | None = None, extra_losses: list[tuple[str, float, list]] = (),
                autocast: bool = False, max_tokens: int = 0, keep_prefix_graph: bool = True) -> dict[str, float]:
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
    encodes (`micro_batches`; 0: g.micro_batch_size rows only); `keep_prefix_graph`: the shared
    prefix's graph may be kept over the micro-batches (`update_prefix`; false for
    `model.recompute_shared_prefix`).
    """
    train_sources = (Source.POLICY, Source.EXPERT)
    members = [i for i in range(len(trajectories)) if not (g.skip_zero_advantage and float(advantages[i]) == 0.0)]
    stats = {M.LOSS_POLICY: 0.0, M.LOSS_KL: 0.0, M.LOSS_TOTAL: 0.0, M.KL_K1_MEAN: 0.0, M.KL_K3_MEAN: 0.0, M.KL_MEAN: 0.0,
             M.LOSS_CLIP_LOW: 0.0, M.LOSS_CLIP_HIGH: 0.0, M.LOSS_RATIO_MEAN: 1.0, M.LOSS_GRAD_NORM: 0.0, M.LOSS_SKIPPED: 0.0,
             M.TOKENS_ENTROPY: 0.0, M.LOSS_TRAINED_MEMBERS: float(len(members))}
    if not members and not extra_losses:
        return stats
    model.train()
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    counts = [sum(1 for s in trajectories[i].sources[1:] if s in train_sources) for i in members]
    num_tokens = sum(counts)
    num_seqs = max(len(members), 1)
    sums = {"pg": 0.0, "kl": 0.0, "k1": 0.0, "k3": 0.0, "low": 0.0, "high": 0.0, "ratio": 0.0, "ent": 0.0}
    kept = [[trajectories[i].token_ids[k] for k in kept_positions(trajectories[i].sources)] for i in members]
    parts = micro_batches(kept, g.micro_batch_size, max_tokens)
    ref_net, ref_mode = reference_network(ref_model, model)
    ref_prefix = None
    with training_passes(model, autocast):
        prefix = update_prefix(model, kept, parts, max_tokens=max_tokens, keep_graph=keep_prefix_graph)
        if ref_net is not None:  # the reference's own encoding of the same prefix: once per update, kept while its weights are the same
            with torch.no_grad(), ref_mode():
                ref_prefix = update_prefix(ref_net, kept, parts, reuse=ref_net is not model)
        for part in parts:
            idx = [members[j] for j in part]
            batch = collate([trajectories[i] for i in idx], sources=train_sources, pad_id=pad_id,
                            advantages=[float(advantages[i]) for i in idx]).to(device)
            logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask, temperature, with_entropy=True,
                                       prefix=prefix)
            if ref_net is None:
                ref_logp = logp.detach()
            else:
                with torch.no_grad(), ref_mode():
                    ref_logp, _ = token_logprobs(ref_net, batch.input_ids, batch.attention_mask, batch.target_mask, temperature, prefix=ref_prefix)
            # Expert tokens (off-policy supervision) were not sampled, and the caller's rows were
            # sampled by other weights or context: their "old" log-prob is the current policy's,
            # taken before the update (ratio 1 at this step, as in paper A).
            rows_from_policy = torch.tensor([old_from_policy is not None and bool(old_from_policy[i]) for i in idx], device=device)  # [B]
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
            with no_autocast(model):
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
            prefix.backward()  # in the precision the prefix was encoded in
    extra_total = 0.0
    if extra_losses:
        for kind, weight, examples in extra_losses:
            if not examples:
                continue
            value = supervision_backward(model, examples, pad_id, weight, g.micro_batch_size, autocast, max_tokens, keep_prefix_graph)
            stats[M.supervision_loss_key(kind)] = value
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


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def train(cfg: Config, out_dir: Path, resume: bool = False, ctx: DistContext | None = None, lock=None, prepared=None) -> dict[str, Any]:
    """Run the whole job into the new directory `out_dir` (or continue it with `resume`);
    returns summary.json's content. Under `torchrun` / `accelerate launch` every process calls
    this with the same arguments (see keel.distributed): rank 0 writes the run directory.
    `lock`: the caller's keel.rundir.RunDirLock on `out_dir` (else, in one process, this call
    takes one for the run and, if the run fails before logging a step, deletes what it created). `prepared`:
    (env, train tasks, dev tasks) the caller already loaded (else keel.tasks.prepare)."""
    ctx = ctx if ctx is not None else init_distributed()
    out_dir = Path(out_dir)
    if ctx.enabled:
        check_distributed_config(cfg, ctx)
    reward_fn = resolve_reward(cfg.reward.name)  # a key of REWARDS or the user's module:function
    if resume and not (out_dir / "config.yaml").exists():
        raise RunDirError(f"--resume {out_dir}: no config.yaml (not a Keel run directory)")
    with run_directory(cfg, out_dir, resume, ctx, lock) as (tracker, interrupted):
        run = start(cfg, out_dir, reward_fn, tracker, interrupted, ctx, prepared)
        try:
            return loop(run, resume)
        finally:
            close_env(run.env)  # e.g. stop an MCP tool server


def loop(run: Run, resume: bool) -> dict[str, Any]:
    """The run, top to bottom (from where a resumed one stopped); returns summary.json's content."""
    cfg = run.cfg
    if resume:
        checkpoint.resume(run)  # from checkpoints/latest, or from step 0 if it was never complete
    p = run.progress
    # 1. the untrained model
    if p.phase == "start":
        if cfg.eval.before_sft:
            means = evaluate(run, "before_sft")
            p.summary["eval_before_sft"] = means
            p.summary["eval_before_sft_step"] = p.step  # the pre-RL eval when SFT is off (rl_lift)
            log(run, {M.PHASE: "eval", **means})
        p.phase = "sft"
        run.optimizer, run.scheduler = make_optimizer(run.model, cfg.sft.lr, cfg.sft.warmup_steps, 0.0, cfg.grpo.adam_eps)
    # 2. SFT warm-start on gold trajectories (paper A's single-step decomposition)
    if p.phase == "sft":
        if cfg.sft.enabled and cfg.sft.steps > 0 and not sft_phase(run):
            return finish(run, interrupted=True)
        if cfg.sft.enabled and cfg.sft.steps > 0:
            run.optimizer = run.scheduler = None  # SFT's AdamW state (2× the weights) is not needed by the eval; RL makes its own
            copy_weights(run.sampler, run.model)
            means = evaluate(run, "after_sft")
            p.summary["eval_after_sft"] = means
            p.summary["eval_after_sft_step"] = p.step
            log(run, {M.PHASE: "eval", **means})
        p.phase = "rl"
        make_reference(run)
        if cfg.run.save_checkpoints:
            checkpoint.save(run, "reference", run.model, None, {"step": p.step})  # the policy is the reference here, in its own dtype
        start = p.summary.get("eval_after_sft") or p.summary.get("eval_before_sft")
        if start:  # where RL starts is the first peak and the detectors' first eval: a cliff in the first window is caught
            handle_alerts(run, dict(start))
            p.peak = {"step": p.step, **start}
            if cfg.run.save_checkpoints:
                checkpoint.save(run, "peak", run.model, None, {"step": p.step, "eval": start})
        g = cfg.grpo
        run.optimizer, run.scheduler = make_optimizer(run.model, g.lr, g.warmup_steps, g.weight_decay, g.adam_eps)
        checkpoint.save_latest(run)
        if interrupted_anywhere(run):  # a signal during the post-SFT eval: stop here, not after a whole RL step
            return finish(run, interrupted=True)
    # 3. GRPO
    if p.phase == "rl":
        if not rl_phase(run):
            return finish(run, interrupted=True)
        p.phase = "done"
    return finish(run)


def sft_phase(run: Run) -> bool:
    """SFT steps until sft.steps are done; False if interrupted (checkpointed)."""
    cfg, p = run.cfg, run.progress
    examples = warm_start_examples(run)

    def step(optimizer, part: list[SFTExample], max_grad_norm: float) -> dict[str, float]:  # one SFT step on this rank's part of a batch
        return sft_step(run.model, optimizer, part, run.pad_id, max_grad_norm, autocast=cfg.model.autocast,
                        max_tokens=cfg.model.max_tokens_per_micro_batch, keep_prefix_graph=not cfg.model.recompute_shared_prefix)

    bar = progress_bar(cfg.sft.steps, "sft", cfg.run.progress and run.ctx.is_main)
    bar.update(p.sft_done)
    while p.sft_done < cfg.sft.steps:
        p.step += 1
        batch = [examples[i] for i in next_batch(run, p.sft_order, cfg.sft.batch_size, len(examples))]
        t0 = time.time()
        lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses; the scheduler then moves to the next
        stats = sharded_sft_step(step, run.model, run.optimizer, batch, run.ctx, cfg.grpo.max_grad_norm)  # keel.distributed
        run.scheduler.step()
        run.model.zero_grad(set_to_none=True)  # no gradient lives between steps (~0.5 GB for SmolLM2)
        p.sft_done += 1
        log(run, {M.PHASE: "sft", **stats, M.OPTIM_LR: lr, M.TIME_UPDATE: time.time() - t0})
        bar.set_postfix(loss=f"{stats[M.LOSS_SFT]:.3f}")
        bar.update(1)
        interrupted = interrupted_anywhere(run)
        if cfg.run.checkpoint_every and p.sft_done % cfg.run.checkpoint_every == 0 or interrupted:
            checkpoint.save_latest(run)
        if interrupted:
            bar.close()
            return False
    bar.close()
    return True


def rl_phase(run: Run) -> bool:
    """GRPO steps until grpo.steps are done, a stop alert fires, or an interrupt (False)."""
    cfg, p = run.cfg, run.progress
    params = SamplingParams(temperature=cfg.rollout.temperature, max_turns=cfg.rollout.max_turns,
                            max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
    bar = progress_bar(cfg.grpo.steps, "grpo", cfg.run.progress and run.ctx.is_main)
    bar.update(p.rl_done)
    while p.rl_done < cfg.grpo.steps:
        p.step += 1
        p.rl_done += 1
        line, stop = rl_step(run, params)
        phase = run.signals.schedule.phase_after(p.rl_done)
        if phase is not None and not stop:
            supervision_phase(run, phase)  # every rank alike: same examples, same rng, same weights
        last = p.rl_done == cfg.grpo.steps
        interrupted = interrupted_anywhere(run)
        if cfg.run.save_checkpoints and (line.get(M.EVAL_EM) is not None or stop or interrupted or last
                                         or (cfg.run.checkpoint_every and p.rl_done % cfg.run.checkpoint_every == 0)):
            checkpoint.save_latest(run)
        if line.get(M.EVAL_EM) is not None:
            refresh_report(run)
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


def supervision_phase(run: Run, phase) -> None:
    """Paper A's interleaved paradigm: `epochs` of supervision (own optimizer and lr) between
    RL steps; each supervision step is one metrics line with phase "sft"."""
    cfg = run.cfg
    examples = [e for k in phase.sources for e in run.signals.supervision_pool(k)]
    if not examples:
        return
    if cfg.signals.phase_examples:
        examples = sample_examples(examples, cfg.signals.phase_examples, run.rng)
    optimizer = adamw(run.model.parameters(), lr=phase.lr, eps=cfg.grpo.adam_eps)
    lines = run_phase(run.model, examples, phase, run.pad_id, cfg.grpo.max_grad_norm, run.rng, cfg.grpo.micro_batch_size,
                      optimizer=optimizer, autocast=cfg.model.autocast, max_tokens=cfg.model.max_tokens_per_micro_batch,
                      keep_prefix_graph=not cfg.model.recompute_shared_prefix)
    for stats in lines:
        run.progress.step += 1
        log(run, {M.PHASE: "sft", **stats, M.SIGNAL_PHASE: phase.kind})
    copy_weights(run.sampler, run.model)


def no_advantage(group_rewards: list[list[float]], baseline: str) -> bool:
    """Whether a batch's rewards leave every advantage 0 (grpo.redraw_flat): each group's rewards
    all equal under the group baseline, the whole batch's under the batch one (there a group that
    all succeeded still differs from the batch mean)."""
    if baseline == "batch":
        rewards = [r for rs in group_rewards for r in rs]
        return not rewards or max(rewards) == min(rewards)
    return all(max(rs) == min(rs) for rs in group_rewards if rs)


def rl_step(run: Run, params: SamplingParams) -> tuple[dict[str, Any], bool]:
    """One GRPO step: rollout → rewards → advantages → update → telemetry → detectors.

    Under several processes each rank rolls out and trains on a contiguous block of the
    step's groups (a group never spans ranks, so advantages stay exact), the gradients are
    combined with token weights, and the trajectories are gathered so every rank computes
    the same metrics line and the detectors take the same decisions.
    """
    cfg, p, ctx, signals = run.cfg, run.progress, run.ctx, run.signals
    s, g = cfg.signals, cfg.grpo
    t0 = time.time()
    t_rollout = 0.0
    for redrawn in range(g.redraw_flat + 1):  # grpo.redraw_flat: a batch with no mixed group is set aside for a fresh one
        batch_tasks = [run.train_tasks[i] for i in next_batch(run, p.rl_order, cfg.rollout.prompts_per_step, len(run.train_tasks), run.strata)]
        rows, groups = sampled_rows(batch_tasks, cfg.rollout.group_size, signals.replaced_slots())
        mine = shard_groups(len(batch_tasks), ctx)
        keep = [i for i, k in enumerate(groups) if k in mine]
        local_rows, local_groups = [rows[i] for i in keep], [groups[i] for i in keep]
        # one generator per row, seeded by (seed, step, group, member): what a row samples does
        # not depend on the rank or the batch it is in; a redrawn batch's groups count on from the last
        first = redrawn * len(batch_tasks)
        gens = [torch.Generator().manual_seed(row_seed(cfg.run.seed, p.rl_done, first + k, i - groups.index(k))) for i, k in zip(keep, local_groups)]
        hints, signal_line = signals.hints(batch_tasks, local_groups)
        t_r = time.time()
        local = rollout(run.sampler, run.tok, run.env, local_rows, params, generator=gens, groups=local_groups, hints=hints,
                        hint_position=s.hint.position, chat=run.chat)
        t_rollout += time.time() - t_r  # time/rollout_s: the rollouts of every batch drawn
        release_free_memory()  # the rollout's KV caches were freed into the heap; the update allocates differently
        score(local, local_rows, run.reward_fn)
        trajs = [t for part in gather_objects(local, ctx) for t in part] if ctx.enabled else local  # all rows, in row order
        group_rewards = [[tr.reward for tr, k in zip(trajs, groups) if k == j] for j in range(len(batch_tasks))]
        if not no_advantage(group_rewards, g.baseline):  # every rank sees every reward: the same decision everywhere
            break
    signal_line.update(signals.observe(p.rl_done, [t.id for t in batch_tasks], group_rewards))
    local_rewards = torch.tensor([tr.reward for tr in local])
    members, adv, ops_line = signals.members(local, local_rewards, local_groups, batch_tasks, mine, run.reward_fn, g, ctx)  # OPS: + gold members
    signal_line.update(ops_line)
    signal_line.update(signals.reflect(trajs, run.rng))  # PRS (one process only): reflections on failed episodes join the pool
    extra = signals.sync_losses(run.rng)  # synchronous paradigm: supervision losses inside this update
    t1 = time.time()
    old_from_policy = signals.old_from_policy(members, other_sampler=run.sampler is not run.model or cfg.model.autocast)
    release_weights(run.sampler, run.model)  # refilled by copy_weights after the update
    sink: list = []
    lr = run.scheduler.get_last_lr()[0]  # the rate this update uses (logged as optim/lr); the scheduler then moves on
    update = ShardedUpdate(run.optimizer, run.model, members, adv, g, ctx)  # one process: run.optimizer and g as they are
    stats = update.finish(grpo_update(run.model, run.ref_model, update.optimizer, members, adv, update.grpo, run.pad_id, cfg.rollout.temperature,
                                      telemetry_sink=sink, old_from_policy=old_from_policy, extra_losses=extra,
                                      autocast=cfg.model.autocast, max_tokens=cfg.model.max_tokens_per_micro_batch,
                                      keep_prefix_graph=not cfg.model.recompute_shared_prefix))
    sink = gather_telemetry(sink, len(local), ctx)  # KL telemetry on the sampled rows of every rank, not gold ones
    run.scheduler.step()
    run.model.zero_grad(set_to_none=True)  # the rollout and evaluations that follow need no gradients
    copy_weights(run.sampler, run.model)
    release_free_memory()  # the update's freed activations, before an evaluation or the next rollout allocates
    t_update = time.time() - t1
    # the structural states read <tool_call> blocks: a healthy Llama-3.1 bare-JSON call would count as full collapse
    line = rl_step_metrics(trajs, rows, groups, len(batch_tasks), stats, signal_line, sink, run.pieces, run.freq_baseline,
                           structural=run.chat is None or run.chat.family == "hermes", lr=lr,
                           t_rollout=t_rollout, t_update=t_update)
    if g.redraw_flat:
        line[M.REWARD_REDRAWN] = redrawn
    if p.rl_done % cfg.eval.every == 0 or p.rl_done == g.steps:
        line.update(evaluate_rl(run))  # and keep the peak: checkpoints/peak
    line[M.TIME_STEP] = time.time() - t0
    stop = handle_alerts(run, line)
    log(run, line)
    return line, stop
