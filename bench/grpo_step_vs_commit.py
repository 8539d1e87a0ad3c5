"""A GRPO step of Keel as it is against Keel at an earlier commit: same checkpoint, config and seed.

Issue 12 asks for a GRPO step "≥ 2× faster than today at the same tokens": "today" is the code
of the day the issue was filed (2f29ca5, the last commit before the work on it). This script
runs `keel train` once per tree — this checkout and `--before`, a worktree of the earlier commit
(`git worktree add /tmp/keel-before 2f29ca5`) — with SFT off, a small final eval, `--steps` GRPO
steps from `--model` (an SFT checkpoint that calls tools, so episodes have several turns), both
through this virtualenv's packages (PYTHONPATH puts the tree's `keel` first). The config is one
file both trees read: the fields that existed on 2f29ca5, the issue's shape (8 prompts × 4,
≤ 128 new tokens a turn, bf16 sampler, autocast) on the full synthetic task.

The trees sample different tokens (the code changed, and with it the numerics and the synthetic
questions), so the work is not identical; the comparison is per token: rollout seconds per
1,000 policy tokens, update seconds per trained member (the update skips members of groups whose
rewards are all equal), and their step total. The first step is a warm-up and is left out.
Runs alternate (before, now, before, now, ...) with `--reps`; medians.

    python bench/grpo_step_vs_commit.py --model runs/X/checkpoints/reference --before /tmp/keel-before

Last line: `step_speedup_per_token=` (before's seconds per step at now's tokens / now's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

CONFIG = """\
model:
  name: {model}
  autocast: true
data:
  max_calls_per_turn: 3
sft:
  enabled: false
grpo:
  steps: {steps}
  lr: 1.0e-5
rollout:
  prompts_per_step: {prompts}
  group_size: {group}
  temperature: 0.7
  max_new_tokens: 128
  dtype: bfloat16
eval:
  before_sft: false
  every: 1000
  n_dev: 4
  batch_size: 4
  max_new_tokens: 32
run:
  seed: {seed}
  threads: {threads}
  progress: false
  save_checkpoints: false
"""


def run_tree(tree: Path, config: Path, out: Path) -> list[dict]:
    """`keel train` from `tree`'s sources; the GRPO steps' metrics lines."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "keel.cli", "train", str(config), "--out", str(out)]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"grpo_step_vs_commit: keel train in {tree} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in lines if "time/rollout_s" in m and "time/update_s" in m]
    print(f"  {tree}: {len(steps)} GRPO steps in {time.time() - t0:.0f} s (whole run)", flush=True)
    return steps


def per_token(steps: list[dict]) -> dict[str, float]:
    timed = steps[1:] or steps  # the first step warms caches and allocators
    tokens = sum(m["rollout/policy_tokens"] for m in timed)
    members = sum(m.get("loss/trained_members", 0.0) for m in timed)
    rollout, update = sum(m["time/rollout_s"] for m in timed), sum(m["time/update_s"] for m in timed)
    return {
        "steps": len(timed),
        "policy_tokens_per_step": tokens / len(timed),
        "trained_members_per_step": members / len(timed),
        "rollout_s_per_step": rollout / len(timed),
        "update_s_per_step": update / len(timed),
        "rollout_s_per_1k_tokens": 1000 * rollout / max(tokens, 1),
        "update_s_per_member": update / max(members, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (an SFT checkpoint that calls tools)")
    ap.add_argument("--before", required=True, help="a Keel source tree at the earlier commit (a git worktree)")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is not timed)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, before = Path(args.model).resolve(), Path(args.before).resolve()
    for p, what in ((model / "config.json", "--model has no config.json"), (before / "keel" / "train.py", "--before is not a Keel tree")):
        if not p.is_file():
            sys.exit(f"grpo_step_vs_commit: {what}: {p}")
    results: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    with tempfile.TemporaryDirectory(prefix="keel-step-bench-") as tmp:
        config = Path(tmp) / "bench.yaml"
        config.write_text(CONFIG.format(model=model, steps=args.steps, prompts=args.prompts, group=args.group, seed=args.seed, threads=args.threads))
        for rep in range(args.reps):
            for label, tree in (("before", before), ("now", HERE)):
                results[label].append(per_token(run_tree(tree, config, Path(tmp) / f"{label}-{rep}")))
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in results.items()}
    print(f"{'':8} {'tokens/step':>11} {'members':>8} {'rollout s':>10} {'update s':>9} {'s/1k tok':>9} {'s/member':>9}")
    for label, m in med.items():
        print(f"{label:8} {m['policy_tokens_per_step']:11.0f} {m['trained_members_per_step']:8.1f} {m['rollout_s_per_step']:10.1f} "
              f"{m['update_s_per_step']:9.1f} {m['rollout_s_per_1k_tokens']:9.2f} {m['update_s_per_member']:9.2f}")
    b, n = med["before"], med["now"]
    # before's step time at now's work: its per-token rollout and per-member update costs, now's counts
    before_at_now = b["rollout_s_per_1k_tokens"] * n["policy_tokens_per_step"] / 1000 + b["update_s_per_member"] * n["trained_members_per_step"]
    now_step = n["rollout_s_per_step"] + n["update_s_per_step"]
    print(f"rollout_speedup_per_token={b['rollout_s_per_1k_tokens'] / n['rollout_s_per_1k_tokens']:.2f}")
    print(f"update_speedup_per_member={b['update_s_per_member'] / max(n['update_s_per_member'], 1e-9):.2f}")
    print(f"step_speedup_per_token={before_at_now / now_step:.2f}")


if __name__ == "__main__":
    main()
