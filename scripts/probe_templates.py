"""Sample a checkpoint on training questions of each RL template and count which call sequences
earn the reward: does the policy ever sample what GRPO would have to reinforce?

    python scripts/probe_templates.py RUN_DIR [--questions 8] [--samples 8] [--turns 4] [--temperature T]

RUN_DIR is a run directory with checkpoints/reference (the post-SFT policy) and config.yaml; the
run's own data settings rebuild its tasks. Samples at the run's rollout.temperature (or
--temperature) in bf16, the reward is r_binary; prints, per template, the successes and the most
frequent relation sequences.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from keel import tasks as task_builder
from keel.config import load_config
from keel.models import load_model
from keel.rewards import r_binary
from keel.rollout import SamplingParams, rollout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--questions", type=int, default=8, help="training questions per template")
    ap.add_argument("--samples", type=int, default=8, help="samples per question")
    ap.add_argument("--turns", type=int, default=4, help="assistant turns per episode")
    ap.add_argument("--checkpoint", default="reference", help="checkpoint under RUN_DIR/checkpoints")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's rollout.temperature)")
    args = ap.parse_args()
    ckpt = args.run_dir / "checkpoints" / args.checkpoint
    if not (args.run_dir / "config.yaml").is_file() or not ckpt.is_dir():
        raise SystemExit(f"probe_templates: {args.run_dir} needs config.yaml and checkpoints/{args.checkpoint}")
    torch.set_num_threads(2)
    cfg = load_config(str(args.run_dir / "config.yaml"), [])
    model, tok = load_model(str(ckpt), dtype="bfloat16")
    model.eval()
    env, train, _ = task_builder.build(cfg)  # no run directory: the tasks in memory, nothing written
    pool = task_builder.rl_pool(cfg, train, "training")
    temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
    params = SamplingParams(temperature=temperature, max_turns=args.turns, max_new_tokens=cfg.rollout.max_new_tokens)
    for template in sorted({t.meta["template"] for t in pool}):
        tasks = [t for t in pool if t.meta["template"] == template][: args.questions]
        tasks = [t for t in tasks for _ in range(args.samples)]
        trajs = rollout(model, tok, env, tasks, params, generator=torch.Generator().manual_seed(cfg.run.seed))
        seen, right = collections.Counter(), collections.Counter()
        for traj, task in zip(trajs, tasks):
            rels = tuple(str((s.call.arguments or {}).get("relation", "?")).split(".")[-1] for s in traj.steps)
            seen[rels] += 1
            right[rels] += r_binary(traj, task)[0]
        print(f"{template}: {int(sum(right.values()))} of {len(tasks)} samples right")
        for rels, n in seen.most_common(12):
            print(f"  {n:3d} ({int(right[rels])} right)  {' -> '.join(rels) or '(no call)'}")


if __name__ == "__main__":
    main()
