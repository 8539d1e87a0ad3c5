"""Peak memory (RSS) of one GRPO step on SmolLM2-135M: rollout + update, full fine-tuning and LoRA.

Each variant runs in a fresh subprocess and reports its own `ru_maxrss` (peak resident set
since the process started, so imports and the model load count too) after: loading the model,
the rollout, and the update. Target ≤ 3 GB.

The step: `--prompts` KG questions × `--group` rollouts (default 2 × 4 = 8 episodes, up to 4
turns of ≤ 96 tokens, the default config's limits) → group advantages from a fixed reward
pattern (half the members rewarded, so every group trains) → `grpo_update` with AdamW and
micro-batch 8 rows, cut further by `model.max_tokens_per_micro_batch` (`--max-tokens`; the
config default unless given). The peak of an update is set by one micro-batch, not by the
number of micro-batches, so the default config's 8 × 4 = 32 episodes peak at the same memory.

- full: every weight trains; the frozen reference is a deep copy (as in `keel.train`).
- full-ckpt / lora-ckpt: the same with decoder-layer gradient checkpointing
  (`model.gradient_checkpointing: true`) and micro-batch 2 (`--ckpt-micro`).
The LM head's logits are recomputed per 256-token chunk in backward in every variant
(`keel.logprobs.token_logprobs`).
- lora: the trainer's LoRA (`keel.models.LoRA`, peft r=16 on the attention and MLP projections;
  `pip install peft==0.21.2`, an optional dependency); rollout and update run its causal LM with
  the adapters injected. The reference is passed as None (KL term 0): with LoRA the reference
  is the base model with the adapter switched off, which needs no second copy; its no-grad
  forward is left out here.

    python bench/step_memory.py                      # full, full-ckpt, lora, lora-ckpt (~5 min)
    python bench/step_memory.py --variants full --prompts 8
    python bench/step_memory.py --mmap-threshold-mb 2        # glibc returns freed tensors (keel/memory.py)
Ends with `peak_rss_<variant>_gb=<x>` per variant.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # kB on Linux


def child(variant: str, prompts: int, group: int, threads: int, ckpt_micro: int = 2, mmap_mb: float = 0.0, max_tokens: int = -1) -> dict:
    import torch

    from keel import metrics as M
    from keel.config import Config
    from keel.kg.env import KGEnv
    from keel.kg.synth import generate_splits
    from keel.losses import group_advantages
    from keel.memory import release_free_memory
    from keel.models import adamw, load_model
    from keel.rollout import SamplingParams, rollout
    from keel.train import grpo_update

    torch.set_num_threads(threads)
    if mmap_mb:
        from keel.memory import set_mmap_threshold

        assert set_mmap_threshold(mmap_mb), "no glibc mallopt"
    out = {"variant": variant}
    model, tok = load_model("smollm2")
    ref = None
    ckpt = variant.endswith("-ckpt")
    if variant.startswith("full"):
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    else:
        from keel.models import LoRA

        model = LoRA(model, rank=16, alpha=32.0).model  # the trainer's LoRA (model.lora_rank: 16)
    out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["rss_after_load_gb"] = _rss_gb()
    kg, splits = generate_splits(seed=0, train=max(prompts, 8), dev=1, test=1)
    env = KGEnv(kg.store)
    tasks = [t for t in splits["train"][:prompts] for _ in range(group)]
    groups = [k for k in range(prompts) for _ in range(group)]
    cfg = Config()
    cfg.grpo.micro_batch_size = ckpt_micro if ckpt else 8
    if max_tokens >= 0:
        cfg.model.max_tokens_per_micro_batch = max_tokens
    out["max_tokens"] = cfg.model.max_tokens_per_micro_batch
    if ckpt:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    t0 = time.perf_counter()
    # the rollout runs on the model being trained (peft's forward adds the adapters)
    trajs = rollout(model, tok, env, tasks, SamplingParams(max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                                                            max_total_tokens=cfg.rollout.max_total_tokens),
                    generator=torch.Generator().manual_seed(0), groups=groups)
    out["rollout_s"] = time.perf_counter() - t0
    out["rss_after_rollout_gb"] = _rss_gb()
    release_free_memory()  # as the trainer does between its rollout and its update
    out["tokens"] = sum(len(t.token_ids) for t in trajs)
    out["policy_tokens"] = sum(t.num_policy_tokens for t in trajs)
    rewards = torch.tensor([float(i % 2) for i in range(len(trajs))])
    adv = group_advantages(rewards, torch.tensor(groups))
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-6)  # the trainer's optimizer
    t0 = time.perf_counter()
    stats = grpo_update(model, ref, opt, trajs, adv, cfg.grpo, tok.pad_token_id, 1.0, max_tokens=cfg.model.max_tokens_per_micro_batch)
    out["update_s"] = time.perf_counter() - t0
    out["trained_members"] = stats[M.LOSS_TRAINED_MEMBERS]
    out["peak_rss_gb"] = _rss_gb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="full,full-ckpt,lora,lora-ckpt", help="comma-separated: full, full-ckpt, lora, lora-ckpt")
    ap.add_argument("--ckpt-micro", type=int, default=2, help="micro-batch of the -ckpt variants")
    ap.add_argument("--mmap-threshold-mb", type=float, default=0.0, help="as run.malloc_mmap_threshold_mb (0: glibc default)")
    ap.add_argument("--max-tokens", type=int, default=-1, help="model.max_tokens_per_micro_batch (default: the config default; 0: no cap)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.prompts, args.group, args.threads, args.ckpt_micro, args.mmap_threshold_mb, args.max_tokens)))
        return
    results = {}
    for variant in args.variants.split(","):
        if variant not in ("full", "full-ckpt", "lora", "lora-ckpt"):
            sys.exit(f"step_memory: unknown variant {variant!r} (full, full-ckpt, lora, lora-ckpt)")
        cmd = [sys.executable, __file__, "--child", variant, "--prompts", str(args.prompts), "--group", str(args.group),
               "--threads", str(args.threads), "--ckpt-micro", str(args.ckpt_micro), "--mmap-threshold-mb", str(args.mmap_threshold_mb),
               "--max-tokens", str(args.max_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            if variant.startswith("lora") and "needs peft" in proc.stderr:
                print("lora: skipped, peft is not installed (pip install torch==2.13.0 peft==0.21.2)")
                continue
            sys.exit(f"step_memory: the {variant} subprocess failed: {tail[0]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[variant] = r
        print(f"{variant}: {r['trainable_params'] / 1e6:.1f}M trainable; {r['tokens']} tokens ({r['policy_tokens']} policy, "
              f"{r['trained_members']:.0f} trained members, token cap {r['max_tokens']}); rollout {r['rollout_s']:.1f} s, update {r['update_s']:.1f} s; "
              f"peak RSS after load {r['rss_after_load_gb']:.2f} GB, after rollout {r['rss_after_rollout_gb']:.2f} GB, "
              f"after update {r['peak_rss_gb']:.2f} GB", flush=True)
    for variant, r in results.items():
        print(f"peak_rss_{variant.replace('-', '_')}_gb={r['peak_rss_gb']:.2f}")


if __name__ == "__main__":
    main()
