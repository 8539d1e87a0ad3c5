"""Achieved FLOP/s of Keel's GRPO update (loss + backward + optimizer step) on SmolLM2-135M,
as a fraction of this machine's GEMM peak measured in the same run (target ≥ 35%).

What is timed: `keel.train.grpo_update` on a step's collated trajectories — the policy's
forward over every token, the frozen reference's forward, the LM head on trained positions
only (chunked), the clipped surrogate + KL, backward, gradient clipping, AdamW — once in fp32
and once under `torch.autocast("cpu", bfloat16)` (fp32 master weights). Trajectories are the
synthetic KG task's gold episodes (prompt ~600 tokens + tool calls, responses and an answer),
their assistant tokens marked as policy tokens, old log-probs set to the model's own (ratio 1,
as at a real step), advantages ±1.

FLOPs are counted, not estimated: `torch.utils.flop_counter.FlopCounterMode` records every
matmul of one update, forward and backward (elementwise work is not counted, so the fraction is
of GEMM work only). Its registry has no formula for the CPU flash-attention kernels, so this
script adds one (`attention_flops`) that counts only the query–key pairs the mask lets through:
4·d FLOPs per visible pair and head forward, 10·d backward (scores recomputed, then dV, dP, dQ,
dK). The total is divided by the median wall time of runs without the counter. Peak: median of
2048×2048 @ 2048×2048 matmuls in fp32 and bf16.

    python bench/train_flops.py                          # 8 trajectories, 2 reps per dtype (~4 min)
    python bench/train_flops.py --trajectories 16 --reps 3 --micro-batch 8
Ends with `fraction_of_peak_fp32=<x>` and `fraction_of_peak_bf16=<x>`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from unittest import mock

import torch
from torch.utils.flop_counter import FlopCounterMode

from keel.config import Config
from keel.kg.env import KGEnv
from keel.kg.synth import generate_splits
from keel.logprobs import collate, token_logprobs
from keel.models import adamw, load_model
from keel.sft import gold_trajectory
from keel.train import grpo_update
from keel.types import Source


def gemm_peak(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """Median FLOP/s of an n×n @ n×n matmul (2·n³ FLOPs each)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def visible_pairs(query, key, is_causal: bool, attn_mask) -> int:
    """Query–key pairs (summed over batch and query heads) that attention actually mixes."""
    b, h, q, k = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if attn_mask is not None:
        seen = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        seen = seen.expand(b, -1, q, k)
        return int(seen.sum()) * (h // seen.shape[1])
    if is_causal:  # top-left aligned: query i sees keys 0..i
        return b * h * sum(min(i + 1, k) for i in range(q))
    return b * h * q * k


def attention_flops(fwd: bool):
    """A FlopCounterMode formula for aten::_scaled_dot_product_flash_attention_for_cpu[_backward]."""

    def count(*args, out_val=None, **kwargs) -> int:
        query, key = (args[0], args[1]) if fwd else (args[1], args[2])
        is_causal = (args[4] if len(args) > 4 else kwargs.get("is_causal", False)) if fwd else args[7]
        pairs = visible_pairs(query, key, bool(is_causal), kwargs.get("attn_mask"))
        return pairs * query.shape[-1] * (4 if fwd else 10)

    count._get_raw = True  # receive the tensors (the mask's contents), not just shapes
    return count


ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: attention_flops(True),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_flops(False),
}


def count_flops(fn) -> FlopCounterMode:
    """Run fn() under a FlopCounterMode with ATTENTION_FLOPS, Keel's bf16 training attention
    switched off for it (KEEL_TRAIN_ATTENTION=0): that kernel is a C call the counter does not
    see, and SDPA in its place mixes the same query–key pairs."""
    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)
    with mock.patch.dict(os.environ, {"KEEL_TRAIN_ATTENTION": "0"}), counter:
        fn()
    return counter


def make_batch(model, tok, n: int, seed: int = 0):
    """n gold KG trajectories with policy-sourced assistant tokens and ratio-1 old log-probs."""
    kg, splits = generate_splits(seed=seed, train=max(n, 8), dev=1, test=1)
    env = KGEnv(kg.store)
    trajs = [gold_trajectory(tok, env, t, source=Source.POLICY) for t in splits["train"][:n]]
    batch = collate(trajs, pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask)
    k = 0
    for b, tr in enumerate(trajs):  # collate drops nothing here (no hints): positions map 1:1
        for i in range(len(tr.token_ids)):
            if batch.target_mask[b, i]:
                tr.logprobs[i] = float(lp[k])
                k += 1
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])
    return trajs, adv


def update_once(model, ref, trajs, adv, cfg, pad_id, autocast: bool) -> float:
    opt = adamw(model.parameters(), lr=1e-6)  # the trainer's optimizer (fused where torch has it)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        stats = grpo_update(model, ref, opt, trajs, adv, cfg.grpo, pad_id, 1.0, max_tokens=cfg.model.max_tokens_per_micro_batch)
    elapsed = time.perf_counter() - t0
    assert stats["loss/skipped_nonfinite"] == 0.0
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2")
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    trajs, adv = make_batch(model, tok, args.trajectories)
    cfg = Config()
    cfg.grpo.micro_batch_size = args.micro_batch
    cfg.model.max_tokens_per_micro_batch = 0  # micro-batches of exactly --micro-batch rows
    cfg.grpo.skip_zero_advantage = False
    n_tokens = sum(len(t.token_ids) for t in trajs)
    n_policy = sum(t.num_policy_tokens for t in trajs)
    width = max(len(t.token_ids) for t in trajs)
    print(f"{args.trajectories} trajectories, {n_tokens} tokens ({n_policy} policy), micro-batch {args.micro_batch}, "
          f"padded to {width} per micro-batch row, threads {torch.get_num_threads()}", flush=True)

    flops = {}
    for name, autocast in (("fp32", False), ("bf16", True)):
        counter = count_flops(lambda: update_once(copy.deepcopy(model), ref, trajs, adv, cfg, tok.pad_token_id, autocast))
        flops[name] = counter.get_total_flops()
        by_op = counter.get_flop_counts()["Global"]
        print(f"  {name} counted: " + ", ".join(f"{op} {n / 1e12:.2f} TFLOP" for op, n in by_op.items()), flush=True)
    peaks = {"fp32": [], "bf16": []}
    times = {"fp32": [], "bf16": []}
    for rep in range(args.reps):  # interleaved: peak fp32, update fp32, peak bf16, update bf16
        for name, autocast in (("fp32", False), ("bf16", True)):
            peaks[name].append(gemm_peak(torch.float32 if name == "fp32" else torch.bfloat16))
            times[name].append(update_once(copy.deepcopy(model), ref, trajs, adv, cfg, tok.pad_token_id, autocast))
            print(f"  rep {rep} {name}: update {times[name][-1]:.2f} s, GEMM peak {peaks[name][-1] / 1e9:.0f} GFLOP/s", flush=True)
    print()
    for name in ("fp32", "bf16"):
        t = statistics.median(times[name])
        peak = statistics.median(peaks[name])
        achieved = flops[name] / t
        print(f"{name}: {flops[name] / 1e12:.2f} TFLOP counted, {t:.2f} s → {achieved / 1e9:.0f} GFLOP/s; "
              f"peak {peak / 1e9:.0f} GFLOP/s; {n_tokens / t:.0f} tokens/s")
    for name in ("fp32", "bf16"):
        print(f"fraction_of_peak_{name}={flops[name] / statistics.median(times[name]) / statistics.median(peaks[name]):.2f}")


if __name__ == "__main__":
    main()
