"""The training loop, top to bottom: optional SFT warm-start, then GRPO with evaluation.

    eval (untrained) → SFT on gold trajectories (paper A's single-step decomposition)
    → eval → reference := policy → repeat: rollout groups → rewards → group advantages
    → clipped surrogate + KL → update → telemetry → [eval, peak checkpoint] → latest checkpoint

Where this departs from the papers: the reference model for the KL term is the policy right
after the SFT warm-start (as in paper A's SFT→GRPO, where the SFT model is the starting point);
one optimizer step per rollout batch, so the importance ratio is 1 at the step (old log-probs
are the sampling log-probs; tests check they equal a recomputation) and clipping acts only
through the ratio's gradient; groups whose rewards are all equal are skipped when
`grpo.skip_zero_advantage` (their policy-gradient term is exactly zero).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import resource
import time
from pathlib import Path
from typing import Any

import torch

from keel import metrics as M
from keel.config import Config, dump_yaml
from keel.evaluate import evaluate_model
from keel.logprobs import collate, token_logprobs
from keel.losses import aggregate, clipped_surrogate, group_advantages, kl_estimate, sft_loss
from keel.models import DTYPES, load_model, resolve_device
from keel.rollout import SamplingParams, rollout
from keel.rundir import append_jsonl, atomic_write_json, atomic_write_text, create_run_dir, swap_dir, write_jsonl
from keel.sft import SFTExample, collate_sft, decompose, gold_trajectory
from keel.types import Source, Task, Trajectory


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _lr_lambda(warmup: int):
    return lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0


class PieceCache:
    """Decoded text of single token ids, cached (telemetry labels tokens by control tag)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        out = []
        for t in ids:
            p = self.cache.get(t)
            if p is None:
                p = self.tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                self.cache[t] = p
            out.append(p)
        return out


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------
def _autocast(enabled: bool, model):
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)


def sft_step(model, optimizer, examples: list[SFTExample], pad_id: int, max_grad_norm: float, micro: int = 8, autocast: bool = False) -> dict[str, float]:
    """One optimizer step of NLL on the examples' target tokens (token-mean over the batch)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n_targets = sum(sum(e.targets[1:]) for e in examples)
    total = 0.0
    for s in range(0, len(examples), micro):
        ids, attn, tmask = collate_sft(examples[s : s + micro], pad_id)
        with _autocast(autocast, model):
            logp, _ = token_logprobs(model, ids, attn, tmask)
        loss = sft_loss(logp, n_targets)
        loss.backward()
        total += float(loss.detach())
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
    cfg: Config,
    pad_id: int,
    temperature: float,
    telemetry_sink: list | None = None,
    old_from_policy: bool = False,
) -> dict[str, float]:
    """One optimizer step of the GRPO loss over the trajectories (gradient-accumulated).

    Loss = aggregate(clipped surrogate) + kl_coef · aggregate(KL(policy || reference)), both
    aggregated over policy (and expert) tokens with the batch-global normalisers, so micro-batch
    size does not change the loss. Returns loss/kl/clip statistics.
    `old_from_policy`: take every token's old log-prob from this policy before the update
    (needed when rollouts were sampled by a lower-precision copy of the weights).
    """
    g = cfg.grpo
    train_sources = (Source.POLICY, Source.EXPERT)
    members = [i for i in range(len(trajectories)) if not (g.skip_zero_advantage and float(advantages[i]) == 0.0)]
    stats = {M.LOSS_POLICY: 0.0, M.LOSS_KL: 0.0, M.LOSS_TOTAL: 0.0, M.KL_K1_MEAN: 0.0, M.KL_K3_MEAN: 0.0, M.KL_MEAN: 0.0,
             M.LOSS_CLIP_LOW: 0.0, M.LOSS_CLIP_HIGH: 0.0, M.LOSS_RATIO_MEAN: 1.0, M.LOSS_GRAD_NORM: 0.0, M.LOSS_SKIPPED: 0.0,
             M.TOKENS_ENTROPY: 0.0, "grpo/trained_members": float(len(members))}
    if not members:
        return stats
    model.train()
    optimizer.zero_grad(set_to_none=True)
    counts = [sum(1 for s in trajectories[i].sources[1:] if s in train_sources) for i in members]
    num_tokens = sum(counts)
    num_seqs = len(members)
    sums = {"pg": 0.0, "kl": 0.0, "k1": 0.0, "k3": 0.0, "low": 0.0, "high": 0.0, "ratio": 0.0, "ent": 0.0}
    for s in range(0, len(members), g.micro_batch_size):
        idx = members[s : s + g.micro_batch_size]
        batch = collate([trajectories[i] for i in idx], sources=train_sources, pad_id=pad_id, advantages=[float(advantages[i]) for i in idx])
        with _autocast(cfg.model.autocast, model):
            logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask, temperature, with_entropy=True)
        with torch.no_grad():
            if ref_model is not None:
                with _autocast(cfg.model.autocast, ref_model):
                    ref_logp, _ = token_logprobs(ref_model, batch.input_ids, batch.attention_mask, batch.target_mask, temperature)
            else:
                ref_logp = logp.detach()
        old = batch.old_logprobs[batch.target_mask]
        # Expert tokens (off-policy supervision) were not sampled: their "old" log-prob is the
        # current policy's, taken before the update (ratio 1 at this step, as in paper A).
        src = torch.zeros_like(batch.target_mask, dtype=torch.long)
        for b, i in enumerate(idx):
            kept = [x for x in trajectories[i].sources if x != Source.HINT]
            src[b, : len(kept)] = torch.tensor(kept)
        expert = (src == Source.EXPERT)[batch.target_mask]
        old = logp.detach() if old_from_policy else torch.where(expert, logp.detach(), old)
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
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), g.max_grad_norm)
    total = sums["pg"] + g.kl_coef * sums["kl"]
    skipped = not (math.isfinite(total) and torch.isfinite(norm))
    if skipped:  # a NaN/inf must not poison the weights: skip the update, log it, keep going
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    n = max(num_tokens, 1)
    stats.update({
        M.LOSS_POLICY: sums["pg"], M.LOSS_KL: sums["kl"], M.LOSS_TOTAL: total,
        M.KL_K1_MEAN: sums["k1"] / n, M.KL_K3_MEAN: sums["k3"] / n, M.KL_MEAN: sums["k3"] / n,
        M.LOSS_CLIP_LOW: sums["low"] / n, M.LOSS_CLIP_HIGH: sums["high"] / n, M.LOSS_RATIO_MEAN: sums["ratio"] / n,
        M.LOSS_GRAD_NORM: float(norm), M.LOSS_SKIPPED: float(skipped), M.TOKENS_ENTROPY: sums["ent"] / n,
    })
    return stats


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, model, tokenizer, optimizer, state: dict[str, Any]) -> None:
    """Write into a temp dir and swap it in: a kill mid-write leaves the previous one intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    atomic_write_json(tmp / "trainer_state.json", state)
    swap_dir(tmp, path)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def train(cfg: Config, out_dir: Path) -> dict[str, Any]:
    """Run the whole job into the new directory `out_dir`; returns summary.json's content."""
    t_start = time.time()
    run = create_run_dir(Path(out_dir))
    atomic_write_text(run / "config.yaml", dump_yaml(cfg))
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    gen = torch.Generator().manual_seed(cfg.run.seed)

    from keel import tasks as task_builder
    from keel.rewards import REWARDS

    if cfg.reward.name not in REWARDS:
        raise ValueError(f"reward.name: unknown reward {cfg.reward.name!r} (known: {', '.join(sorted(REWARDS))})")
    reward_fn = REWARDS[cfg.reward.name]
    from keel.config import to_dict
    from keel.diagnostics.detectors import Detectors
    from keel.diagnostics.episode_metrics import episode_record, tool_metrics
    from keel.diagnostics.states import structural_shares
    from keel.diagnostics.telemetry import ControlFrequencyBaseline, control_tag_frequency
    from keel.trackers import make_tracker

    tracker = make_tracker(cfg.report_to, run, config=to_dict(cfg), run_name=run.name)  # fails here, before training, if a package is missing
    try:
        return _train(cfg, run, t_start, rng, gen, reward_fn, tracker, Detectors(cfg.detectors), ControlFrequencyBaseline(),
                      episode_record, tool_metrics, structural_shares, control_tag_frequency)
    finally:
        tracker.close()


def _train(cfg, run, t_start, rng, gen, reward_fn, tracker, detectors, freq_baseline,
           episode_record, tool_metrics, structural_shares, control_tag_frequency) -> dict[str, Any]:
    from keel import tasks as task_builder

    device = resolve_device(cfg.model.device)
    model, tok = load_model(cfg.model.name, cfg.model.dtype, cfg.run.seed, device)
    env, train_tasks, dev_tasks = task_builder.build(cfg, run)
    pad_id = tok.pad_token_id
    pieces = PieceCache(tok)
    dev = dev_tasks[: cfg.eval.n_dev]
    tasks_by_id = {t.id: t for t in train_tasks + dev}
    show = cfg.run.progress
    summary: dict[str, Any] = {"run_dir": str(run), "model": cfg.model.name, "n_train": len(train_tasks), "n_dev_eval": len(dev)}
    step = 0
    peak = {"step": None, M.EVAL_EM: -1.0}

    def log(line: dict[str, Any]) -> None:
        line = {M.STEP: step, **line, M.TIME_WALL: time.time() - t_start, M.MEM_PEAK_RSS: _peak_rss_mb()}
        append_jsonl(run / "metrics.jsonl", line)
        tracker.log(step, {k: v for k, v in line.items() if isinstance(v, (int, float)) and k != M.STEP})

    def refresh_report() -> None:
        try:  # the report is a view; failing to draw it must not stop training
            from keel.report import write_report

            write_report(run)
        except Exception as exc:
            print(f"[keel] warning: report not written: {type(exc).__name__}: {exc}", flush=True)

    sampler = model
    if cfg.rollout.dtype != cfg.model.dtype:
        sampler = copy.deepcopy(model).to(DTYPES[cfg.rollout.dtype]).eval()
        for p in sampler.parameters():
            p.requires_grad_(False)

    def sync_sampler() -> None:
        if sampler is not model:
            with torch.no_grad():
                for ps, pm in zip(sampler.parameters(), model.parameters()):
                    ps.copy_(pm)

    def run_eval(label: str) -> dict[str, float]:
        params = SamplingParams(temperature=1.0, greedy=True, max_turns=cfg.rollout.max_turns,
                                max_new_tokens=cfg.eval.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
        bar = _progress(len(dev), f"eval ({label})", show)
        means, rows, trajs = evaluate_model(sampler, tok, env, dev, params, cfg.eval.batch_size, progress=bar.update)
        bar.close()
        write_jsonl(run / "eval" / f"step_{step:06d}.jsonl", [{**r, "label": label} for r in rows])
        write_jsonl(run / "samples" / f"step_{step:06d}.jsonl",
                    [{**tr.to_dict(), "pieces": pieces(tr.token_ids), "question": tasks_by_id[tr.task_id].question, "label": label}
                     for tr in trajs[: cfg.eval.samples]])
        print(f"[keel] step {step} eval ({label}): EM {means[M.EVAL_EM]:.3f}  F1 {means[M.EVAL_F1]:.3f}  "
              f"format-valid {means[M.EVAL_FORMAT_VALID]:.3f}  tools/q {means[M.EVAL_TOOLS_PER_QUESTION]:.2f}", flush=True)
        return means

    # ---- 1. the untrained model ----
    if cfg.eval.before_sft:
        means = run_eval("before_sft")
        summary["eval_before_sft"] = means
        log({M.PHASE: "eval", **means})

    # ---- 2. SFT warm-start on gold trajectories (single-step decomposition) ----
    if cfg.sft.enabled and cfg.sft.steps > 0:
        golds = [gold_trajectory(tok, env, t) for t in train_tasks]
        examples = [e for g in golds if g.info.get("gold_ok", True) for e in decompose(g, packed=cfg.sft.packed)]
        summary["sft_examples"] = len(examples)
        summary["sft_gold_failed"] = sum(1 for g in golds if not g.info.get("gold_ok", True))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.sft.warmup_steps))
        order: list[int] = []
        bar = _progress(cfg.sft.steps, "sft", show)
        for _ in range(cfg.sft.steps):
            step += 1
            batch = []
            while len(batch) < cfg.sft.batch_size:
                if not order:
                    order = list(range(len(examples)))
                    rng.shuffle(order)
                batch.append(examples[order.pop()])
            t0 = time.time()
            stats = sft_step(model, opt, batch, pad_id, cfg.grpo.max_grad_norm, autocast=cfg.model.autocast)
            sched.step()
            log({M.PHASE: "sft", **stats, M.OPTIM_LR: sched.get_last_lr()[0], M.TIME_UPDATE: time.time() - t0})
            bar.set_postfix(loss=f"{stats[M.LOSS_SFT]:.3f}")
            bar.update(1)
        bar.close()
        del opt
        sync_sampler()
        means = run_eval("after_sft")
        summary["eval_after_sft"] = means
        log({M.PHASE: "eval", **means})

    # ---- 3. GRPO ----
    # The frozen reference: the policy as RL starts. Kept even at kl_coef 0, because the
    # per-token KL telemetry (which tokens drift) reads it.
    ref_model = copy.deepcopy(model).eval()
    for p in ref_model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.grpo.warmup_steps))
    params = SamplingParams(temperature=cfg.rollout.temperature, max_turns=cfg.rollout.max_turns,
                            max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
    order = []
    last_eval: dict[str, float] | None = None
    bar = _progress(cfg.grpo.steps, "grpo", show)
    for rl_step in range(1, cfg.grpo.steps + 1):
        step += 1
        t0 = time.time()
        batch_tasks: list[Task] = []
        while len(batch_tasks) < cfg.rollout.prompts_per_step:
            if not order:
                order = list(range(len(train_tasks)))
                rng.shuffle(order)
            batch_tasks.append(train_tasks[order.pop()])
        rows = [t for t in batch_tasks for _ in range(cfg.rollout.group_size)]
        groups = [k for k in range(len(batch_tasks)) for _ in range(cfg.rollout.group_size)]
        trajs = rollout(sampler, tok, env, rows, params, generator=gen, groups=groups)
        t_rollout = time.time() - t0
        comps: dict[str, list[float]] = {}
        for tr, task in zip(trajs, rows):
            try:
                total, parts = reward_fn(tr, task)
            except Exception as exc:  # one odd sample must not crash a long run
                total, parts = 0.0, {"reward_error": 1.0}
                tr.info["reward_error"] = f"{type(exc).__name__}: {exc}"
            tr.reward = float(total)
            tr.reward_components = parts
            for k, v in parts.items():
                comps.setdefault(k, []).append(float(v))
        rewards = torch.tensor([tr.reward for tr in trajs])
        adv = group_advantages(rewards, torch.tensor(groups), cfg.grpo.scale_by_std)
        t1 = time.time()
        sink: list = []
        stats = grpo_update(model, ref_model, opt, trajs, adv, cfg, pad_id, cfg.rollout.temperature, sink,
                            old_from_policy=sampler is not model or cfg.model.autocast)
        sched.step()
        sync_sampler()
        t_update = time.time() - t1
        n_policy = sum(tr.num_policy_tokens for tr in trajs)
        mixed = sum(1 for k in range(len(batch_tasks)) if rewards[[g == k for g in groups]].std() > 0) / len(batch_tasks)
        line: dict[str, Any] = {
            M.PHASE: "rl",
            M.REWARD_MEAN: float(rewards.mean()),
            M.REWARD_STD: float(rewards.std()) if len(rewards) > 1 else 0.0,
            M.REWARD_MIXED_GROUPS: mixed,
            **{M.REWARD_COMPONENT_PREFIX + k: sum(v) / len(v) for k, v in comps.items()},
            **stats,
            M.TOOLS_PER_QUESTION: sum(len(tr.steps) for tr in trajs) / len(trajs),
            M.TOOLS_VALID_CALLS: _share([s.observation.ok for tr in trajs for s in tr.steps]),
            M.ROLLOUT_POLICY_TOKENS: float(n_policy),
            M.ROLLOUT_TOKENS_PER_S: n_policy / max(t_rollout, 1e-9),
            M.ROLLOUT_MEAN_TURNS: sum(len(tr.turn_spans) for tr in trajs) / len(trajs),
            M.ROLLOUT_TRUNCATED: sum(tr.truncated for tr in trajs) / len(trajs),
            M.TIME_ROLLOUT: t_rollout,
            M.TIME_UPDATE: t_update,
            M.OPTIM_LR: sched.get_last_lr()[0],
        }
        line.update(_telemetry(sink, pieces))
        line.update(tool_metrics([episode_record(tr, task) for tr, task in zip(trajs, rows)]))
        line.update(structural_shares(trajs))
        freqs = control_tag_frequency([pieces([t for t, s in zip(tr.token_ids, tr.sources) if s == Source.POLICY]) for tr in trajs])
        freq_baseline.record(freqs)  # first RL step: the policy equals the reference model
        line.update(freq_baseline.metrics(freqs))
        is_eval = rl_step % cfg.eval.every == 0 or rl_step == cfg.grpo.steps
        if is_eval:
            last_eval = run_eval(f"rl_step_{rl_step}")
            line.update(last_eval)
            if last_eval[M.EVAL_EM] > peak[M.EVAL_EM]:
                peak = {"step": step, M.EVAL_EM: last_eval[M.EVAL_EM], **last_eval}
                if cfg.run.save_checkpoints:
                    save_checkpoint(run / "checkpoints" / "peak", model, tok, None, {"step": step, "eval": last_eval})
        line[M.TIME_STEP] = time.time() - t0
        alerts = detectors.update(step, line)
        stop = False
        for alert in alerts:
            record = alert.to_dict()
            if alert.action == "rollback":
                record["rolled_back_to"] = _rollback(model, run, cfg, alert.on_rollback)
                if record["rolled_back_to"] is not None:
                    sync_sampler()
                    line[M.ALERT_ROLLBACK] = 1.0
                    opt = torch.optim.AdamW(model.parameters(), lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(0))
                    record["config_now"] = {k: _get_key(cfg, k) for k in alert.on_rollback}
            elif alert.action == "stop":
                stop = True
            append_jsonl(run / "alerts.jsonl", record)
            print(f"[keel] step {step} ALERT {alert.kind}: {alert.suggested_action} (action: {alert.action})", flush=True)
        line[M.ALERT_COUNT] = float(len(alerts))
        log(line)
        if cfg.run.save_checkpoints and (is_eval or stop or (cfg.run.checkpoint_every and rl_step % cfg.run.checkpoint_every == 0)):
            save_checkpoint(run / "checkpoints" / "latest", model, tok, opt, {"step": step, "rl_step": rl_step})
        if is_eval:
            refresh_report()
        if stop:
            summary["stopped_by_alert"] = {"step": step, "kinds": [a.kind for a in alerts if a.action == "stop"]}
            bar.close()
            break
        bar.set_postfix(reward=f"{line[M.REWARD_MEAN]:.3f}", em=f"{last_eval[M.EVAL_EM]:.2f}" if last_eval else "-")
        bar.update(1)
    bar.close()

    summary["eval_final"] = last_eval if last_eval is not None else summary.get("eval_after_sft") or summary.get("eval_before_sft")
    summary["peak"] = peak if peak["step"] is not None else None
    summary["steps"] = step
    summary["grpo_steps"] = cfg.grpo.steps
    summary["wall_time_s"] = time.time() - t_start
    atomic_write_json(run / "summary.json", summary)
    refresh_report()
    return summary


def _get_key(cfg: Config, key: str):
    obj = cfg
    for p in key.split("."):
        obj = getattr(obj, p)
    return obj


def _rollback(model, run: Path, cfg: Config, overrides: dict[str, str]) -> int | None:
    """Load the `peak` checkpoint's weights and apply the alert's config changes ("x5" multiplies).

    Returns the peak's step, or None when there is no peak yet (the alert is then only logged).
    """
    from safetensors.torch import load_file

    from keel.config import set_key

    peak = run / "checkpoints" / "peak"
    if not (peak / "model.safetensors").exists():
        return None
    state = load_file(str(peak / "model.safetensors"))
    model.load_state_dict(state, strict=False)  # tied lm_head is not stored separately
    for key, value in overrides.items():
        current = _get_key(cfg, key)
        if isinstance(value, str) and value.startswith("x") and isinstance(current, (int, float)):
            set_key(cfg, key, float(current) * float(value[1:]))
        else:
            import yaml

            set_key(cfg, key, yaml.safe_load(value) if isinstance(value, str) else value)
    return int(json.loads((peak / "trainer_state.json").read_text())["step"])


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 1.0


def _telemetry(sink: list, pieces: PieceCache) -> dict[str, float]:
    """Control-tag KL telemetry of the trained tokens (see keel.diagnostics.telemetry)."""
    if not sink:
        return {}
    from keel.chat import token_tag_labels
    from keel.diagnostics.telemetry import token_telemetry

    sink.sort(key=lambda x: x[0])
    tok_pieces = [pieces(ids) for _, ids, _, _, _ in sink]
    labels = [token_tag_labels(p) for p in tok_pieces]
    metrics, _top = token_telemetry([x[2] for x in sink], [x[3] for x in sink], [x[4] for x in sink], labels, tok_pieces)
    return metrics
