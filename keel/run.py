"""One run's objects, and the services the training loop (keel.train) calls on them.

`Run` is plain state: what the loop's functions read and change, and what keel.checkpoint
saves and restores. It has no behaviour of its own; the functions below set it up (`start`),
write a metrics line (`log`), evaluate the policy (`evaluate`, `evaluate_rl`), pick the SFT
warm-start's data (`warm_start_examples`), act on the detectors' alerts (`handle_alerts`) and
write summary.json (`finish`). `run_directory` holds the run directory, the tracker and the
signal handler for the length of a run.
"""

from __future__ import annotations

import contextlib
import copy
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from keel import checkpoint
from keel import metrics as M
from keel.checkpoint import Progress
from keel.config import Config, dump_yaml, get_key, signal_sections
from keel.distributed import DistContext, all_reduce_sum, barrier, broadcast_object, gather_objects, shard_groups
from keel.diagnostics.detectors import Detectors
from keel.diagnostics.step_metrics import PieceCache
from keel.diagnostics.telemetry import ControlFrequencyBaseline
from keel.errors import UserError
from keel.evaluate import evaluate_model
from keel.memory import keep_freed_memory, release_free_memory, set_mmap_threshold
from keel.models import DTYPES, LoRA, frozen_copy, frozen_reference, load_model, native_bf16, resolve_device
from keel.rollout import SamplingParams
from keel.rundir import append_jsonl, atomic_write_json, atomic_write_text, write_jsonl
from keel.sft import SFTExample, decompose, gold_trajectory
from keel.signals.schedule import Schedule
from keel.signals.state import SignalState
from keel.templates import ChatTemplate, for_run
from keel.types import Env, Task


@dataclass
class Run:
    """Everything one run holds. The policy's weights live in `model`; `sampler` is `model`
    itself or a lower-precision copy that rollouts use; `ref_model` is the KL reference (a frozen
    copy, or the LoRA wrapper whose adapters-off model is the reference)."""

    cfg: Config
    run_dir: Path
    ctx: DistContext
    tracker: Any  # keel.trackers: metrics lines go to it too
    interrupted: Interrupted
    reward_fn: Callable  # (trajectory, task) -> (total, components)
    model: Any
    tok: Any
    chat: ChatTemplate | None  # None: Keel's Hermes layout; else the model's own template renders every episode
    lora: LoRA | None
    sampler: Any
    env: Env
    train_tasks: list[Task]  # what RL draws from (data.rl_templates' questions)
    sft_tasks: list[Task]  # the warm-start's questions (data.sft_templates'; every training question by default)
    dev: list[Task]  # the dev questions every evaluation uses
    tasks_by_id: dict[str, Task]
    progress: Progress
    rng: random.Random  # the same on every rank: ranks agree on batches and phases
    signals: SignalState
    detectors: Detectors
    freq_baseline: ControlFrequencyBaseline
    pieces: PieceCache
    t_start: float
    strata: list[str] | None = None  # rollout.stratify_by's value per training task (keel.tasks.strata)
    ref_model: Any = None
    optimizer: Any = None
    scheduler: Any = None

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id


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


def check_distributed_config(cfg: Config, ctx: DistContext) -> None:
    """What runs data-parallel: SFT, GRPO (groups sharded), OPS, hints, ETS and interleaved
    supervision phases (the latter repeated identically on every rank). PRS and synchronous
    supervision losses normalise by local counts inside the update and are refused, as is any
    signal whose section names a reason (keel.config.SignalSection.ONE_PROCESS)."""
    for sec in signal_sections(cfg.signals):
        if sec.ONE_PROCESS and sec.on():
            raise UserError(f"distributed: {sec.label()} ({sec.ONE_PROCESS}) runs in one process only; {ctx.world_size} processes were started")
    schedule = Schedule.from_config(cfg.signals, cfg.grpo.lr)
    if any(schedule.sync_weight(k) > 0 for k in schedule.kinds):
        raise UserError("distributed: synchronous supervision losses (signals.paradigm=synchronous) run in one process only")
    shard_groups(cfg.rollout.prompts_per_step, ctx)  # prompts_per_step must divide evenly


@contextlib.contextmanager
def run_directory(cfg: Config, run_dir: Path, resume: bool, ctx: DistContext, lock=None):
    """The run directory for the length of a run; yields (tracker, interrupted).

    Without the caller's `lock` (and in one process) the directory is claimed, or locked on
    resume, and released at the end; a fresh one whose run fails before logging a step is
    deleted. config.yaml is written (on resume: the checkpoint checked, config.yaml rewritten
    when --set changed it), this process's thread / malloc / progress-bar settings applied, the
    tracker made (a missing package fails here, before training; other ranks log nothing) and
    the SIGINT/SIGTERM handler installed.
    """
    from keel.config import to_dict
    from keel.rundir import claim_run_dir, lock_run_dir, usable_checkpoint
    from keel.trackers import make_tracker

    own = []
    if lock is None and not ctx.enabled:  # one process owns the directory for the whole run (under torchrun: the CLI's rank 0)
        own.append(lock_run_dir(run_dir) if resume else claim_run_dir(run_dir))
    try:
        if resume:
            def check_and_record():
                usable_checkpoint(run_dir / "checkpoints" / "latest")  # corrupt latest: fall back to .old, or say what to do
                text = dump_yaml(cfg)
                if (run_dir / "config.yaml").read_text(encoding="utf-8") != text:  # --set on resume is part of the run from now on
                    atomic_write_text(run_dir / "config.yaml", text)
            _on_main(check_and_record, ctx)
        else:
            if ctx.is_main:
                atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
            barrier(ctx)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if cfg.run.keep_freed_memory:
            if not keep_freed_memory() and ctx.is_main:
                print("[keel] warning: run.keep_freed_memory has no effect here (no glibc mallopt)", flush=True)
        if cfg.run.malloc_mmap_threshold_mb:
            if not set_mmap_threshold(cfg.run.malloc_mmap_threshold_mb) and ctx.is_main:
                print("[keel] warning: run.malloc_mmap_threshold_mb has no effect here (no glibc mallopt)", flush=True)
        if not cfg.run.progress:  # transformers' own bars ("Writing model shards") follow run.progress too
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        tracker = make_tracker(cfg.report_to if ctx.is_main else [], run_dir, config=to_dict(cfg), run_name=run_dir.name)
        try:
            with Interrupted() as interrupted:
                yield tracker, interrupted
        finally:
            tracker.close()
    except BaseException:
        if own and not resume:
            own[0].discard_if_fresh()
        raise
    finally:
        if own:
            own[0].release()


def start(cfg: Config, run_dir: Path, reward_fn, tracker, interrupted: Interrupted, ctx: DistContext, prepared=None) -> Run:
    """Seed, load the model (LoRA, checkpointing, a sampler copy in rollout.dtype), the tasks
    (rank 0 first: it writes run/data) and the signals: the run as it stands at step 0."""
    from keel import tasks as task_builder

    t_start = time.time()
    device = resolve_device(cfg.model.device)
    cfg, precision = resolve_precision(cfg, device)
    if precision and ctx.is_main:
        print(f"[keel] precision: {precision}", flush=True)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    model, tok = load_model(cfg.model.name, cfg.model.dtype, cfg.run.seed, device,
                            own_template=cfg.model.chat_format == "template")
    chat = for_run(cfg, tok)
    lora = None
    if cfg.model.lora_rank > 0:
        lora = LoRA(model, cfg.model.lora_rank, cfg.model.lora_alpha)
        model = lora.model
    if cfg.model.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for main_turn in (True, False):  # rank 0 writes run/data (synthetic data) before the others read it
        if ctx.is_main == main_turn:
            env, train_tasks, dev_tasks = prepared or task_builder.prepare(cfg, run_dir, tok, chat)
        barrier(ctx)
    dev = dev_tasks[: cfg.eval.n_dev]
    sft_tasks, train_tasks = task_builder.sft_pool(cfg, train_tasks), task_builder.rl_pool(cfg, train_tasks, "training")
    tasks_by_id = {t.id: t for t in sft_tasks + train_tasks + dev}
    pieces, detectors, freq_baseline = PieceCache(tok), Detectors(cfg.detectors), ControlFrequencyBaseline()
    progress = Progress(summary={"run_dir": str(run_dir), "model": cfg.model.name, "n_train": len(train_tasks), "n_sft": len(sft_tasks), "n_dev_eval": len(dev)})
    sampler = model if cfg.rollout.dtype == cfg.model.dtype else frozen_copy(model, DTYPES[cfg.rollout.dtype])
    signals = SignalState(cfg.signals, cfg.grpo.lr, env, tok, train_tasks, tasks_by_id, cfg.sft.packed)
    return Run(cfg=cfg, run_dir=run_dir, ctx=ctx, tracker=tracker, interrupted=interrupted, reward_fn=reward_fn, model=model, tok=tok,
               chat=chat, lora=lora, sampler=sampler, env=env, train_tasks=train_tasks, sft_tasks=sft_tasks, dev=dev, tasks_by_id=tasks_by_id,
               progress=progress, rng=rng, signals=signals, detectors=detectors, freq_baseline=freq_baseline, pieces=pieces,
               t_start=t_start, strata=task_builder.strata(train_tasks, cfg.rollout.stratify_by))


def resolve_precision(cfg: Config, device: str) -> tuple[Config, str]:
    """`cfg` with `rollout.dtype: auto` and `model.autocast: auto` made concrete for `device`:
    bf16 where it multiplies bf16 natively (keel.models.native_bf16), fp32 where bf16 would be
    emulated and slower. Returns (a copy when anything was auto, else `cfg`; what was decided, in
    words, "" when nothing was auto). config.yaml keeps `auto`: a resumed run decides again on
    its own machine (exact either way: the update recomputes old log-probs when the sampler's
    dtype differs from the policy's); summary.json's `precision` records what ran."""
    auto = [k for k, v in (("rollout.dtype", cfg.rollout.dtype), ("model.autocast", cfg.model.autocast)) if v == "auto"]
    if not auto:
        return cfg, ""
    fast = native_bf16(device)
    cfg = copy.deepcopy(cfg)
    if cfg.rollout.dtype == "auto":
        cfg.rollout.dtype = "bfloat16" if fast else "float32"
    if cfg.model.autocast == "auto":
        cfg.model.autocast = fast
    why = f"{device} multiplies bf16 natively" if fast else f"{device} has no native bf16 matmul ({torch.backends.cpu.get_cpu_capability() if device == 'cpu' else device}): bf16 would be emulated, slower than fp32"
    return cfg, f"{' and '.join(auto)} auto → rollouts in {cfg.rollout.dtype}, autocast {'on' if cfg.model.autocast else 'off'} ({why})"


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def say(run: Run, message: str) -> None:
    if run.ctx.is_main:
        print(message, flush=True)


def log(run: Run, line: dict[str, Any]) -> None:
    """One line of metrics.jsonl (rank 0) and the tracker: the step, `line`, wall time and peak RSS."""
    line = {M.STEP: run.progress.step, **line, M.TIME_WALL: time.time() - run.t_start,
            M.MEM_PEAK_RSS: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    release_free_memory()  # a line ends a step or an evaluation: hand that phase's freed heap back
    run.progress.metrics_lines += 1
    if not run.ctx.is_main:
        return
    append_jsonl(run.run_dir / "metrics.jsonl", line)
    run.tracker.log(run.progress.step, {k: v for k, v in line.items() if isinstance(v, (int, float)) and k != M.STEP})


def refresh_report(run: Run) -> None:
    if not run.ctx.is_main:
        return
    try:  # the report is a view; failing to draw it must not stop training
        from keel.report import write_report

        write_report(run.run_dir)
    except Exception as exc:
        print(f"[keel] warning: report not written: {type(exc).__name__}: {exc}", flush=True)


def make_reference(run: Run) -> None:
    """The frozen reference: the policy as RL starts. Kept even at kl_coef 0, because the
    per-token KL telemetry (which tokens drift) reads it."""
    if run.lora is not None:  # the SFT model = adapters off after folding: no copy
        run.lora.fold()
        run.ref_model = run.lora
        return
    run.ref_model = frozen_reference(run.model, run.cfg.model.autocast)


def evaluate(run: Run, label: str) -> dict[str, float]:
    """Greedy dev evaluation. Under several processes each rank takes a contiguous shard of
    the dev set and the records are gathered (in rank order = dev order) before the means."""
    cfg, ctx = run.cfg, run.ctx
    params = SamplingParams(temperature=1.0, greedy=True, max_turns=cfg.rollout.max_turns,
                            max_new_tokens=cfg.eval.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
    per = -(-len(run.dev) // ctx.world_size)
    mine = run.dev[ctx.rank * per : (ctx.rank + 1) * per]
    bar = progress_bar(len(mine), f"eval ({label})", cfg.run.progress and ctx.is_main)
    means, rows, trajs = evaluate_model(run.sampler, run.tok, run.env, mine, params, cfg.eval.batch_size, progress=bar.update, chat=run.chat)
    bar.close()
    if ctx.enabled:
        from keel.diagnostics.episode_metrics import eval_metrics

        rows = [r for part in gather_objects(rows, ctx) for r in part]
        trajs = [t for part in gather_objects(trajs[: cfg.eval.samples], ctx) for t in part]
        means = eval_metrics(rows)
    step = run.progress.step
    if ctx.is_main:
        write_jsonl(run.run_dir / "eval" / f"step_{step:06d}.jsonl", [{**r, "label": label} for r in rows])
        write_jsonl(run.run_dir / "samples" / f"step_{step:06d}.jsonl",
                    [{**tr.to_dict(), "pieces": run.pieces(tr.token_ids), "question": run.tasks_by_id[tr.task_id].question, "label": label}
                     for tr in trajs[: cfg.eval.samples]])
    if cfg.eval.tool_lift_n > 0:  # on every rank alike (same weights, same generator): same numbers
        from keel.evaluate import tool_lift_metrics

        sampled = SamplingParams(temperature=cfg.rollout.temperature, max_turns=cfg.rollout.max_turns,
                                 max_new_tokens=cfg.eval.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
        # its own seeded generator: tool lift must not shift the training rollouts' randomness
        lift_gen = torch.Generator().manual_seed(cfg.run.seed * 1000003 + step)
        means.update(tool_lift_metrics(run.sampler, run.tok, run.env, run.dev[: cfg.eval.tool_lift_n], sampled,
                                       cfg.eval.tool_lift_k, lift_gen, cfg.eval.batch_size, chat=run.chat))
    say(run, f"[keel] step {step} eval ({label}): EM {means[M.EVAL_EM]:.3f}  F1 {means[M.EVAL_F1]:.3f}  "
             f"format-valid {means[M.EVAL_FORMAT_VALID]:.3f}  tools/q {means[M.EVAL_TOOLS_PER_QUESTION]:.2f}")
    return means


def evaluate_rl(run: Run) -> dict[str, float]:
    """The evaluation at an RL step; it becomes progress.last_eval, and a new best dev EM the
    peak (checkpoints/peak: what a rollback alert loads)."""
    p = run.progress
    p.last_eval = evaluate(run, f"rl_step_{p.rl_done}")
    if p.last_eval[M.EVAL_EM] > p.peak[M.EVAL_EM]:
        p.peak = {"step": p.step, **p.last_eval}
        if run.cfg.run.save_checkpoints:
            checkpoint.save(run, "peak", run.model, None, {"step": p.step, "eval": p.last_eval})
    return p.last_eval


def warm_start_examples(run: Run) -> list[SFTExample]:
    """The SFT warm-start's examples: the training tasks' gold trajectories, one example per
    assistant turn (paper A), or with signals.self_distill.trajectories a checkpoint's own kept
    episodes (paper B rung 7, ReST-EM: SFT from the base). The summary records which."""
    cfg, summary = run.cfg, run.progress.summary
    if cfg.signals.self_distill.trajectories:
        from keel.signals.restem import read_trajectories, self_distillation_examples

        path = Path(cfg.signals.self_distill.trajectories)
        if not path.exists():
            raise FileNotFoundError(f"signals.self_distill.trajectories: file not found: {path} (make it with `keel distill`)")
        examples = self_distillation_examples(read_trajectories(path), packed=cfg.sft.packed)
        if not examples:
            raise UserError(f"signals.self_distill.trajectories: {path} has no usable episodes")
        summary["sft_source"] = f"self-distillation: {path}"
    else:
        golds = [gold_trajectory(run.tok, run.env, t, chat=run.chat) for t in run.sft_tasks]
        examples = [e for g in golds if g.info.get("gold_ok", True) for e in decompose(g, packed=cfg.sft.packed)]
        if not examples:
            raise UserError("sft: no gold trajectory could be replayed in the environment (every gold call failed)")
        summary["sft_gold_failed"] = sum(1 for g in golds if not g.info.get("gold_ok", True))
    summary["sft_examples"] = len(examples)
    return examples


def interrupted_anywhere(run: Run) -> bool:
    """SIGINT reaches each rank at its own moment: the ranks agree (any of them) at step ends,
    so all checkpoint and stop at the same step instead of waiting on each other forever."""
    if not run.ctx.enabled:
        return run.interrupted.flag
    run.interrupted.flag = all_reduce_sum([float(run.interrupted.flag)], run.ctx)[0] > 0
    return run.interrupted.flag


def next_batch(run: Run, order: list[int], n: int, pool: int, strata: list[str] | None = None) -> list[int]:
    """n indices from an epoch order, a new one when an epoch ends (order is Progress state, and
    is popped from its end). `strata` (one value per index): the epoch is `stratified_order`'s."""
    out = []
    while len(out) < n:
        if not order:
            if strata is None:
                order.extend(range(pool))
                run.rng.shuffle(order)
            else:
                order.extend(reversed(stratified_order(run.rng, strata)))
        out.append(order.pop())
    return out


def stratified_order(rng: random.Random, strata: list[str]) -> list[int]:
    """All indices, the strata's values taken in turn (each value's indices shuffled, the values'
    cycle shuffled once per epoch): any run of k consecutive indices holds each value ⌊k/V⌋ or
    ⌈k/V⌉ times while every value still has indices left. A plain shuffle at 8 prompts a step sees
    a template three times in one batch and not at all in the next. On the main job this alone did
    not make GRPO's lift reliable (docs/RESULTS.md, ninth session)."""
    groups: dict[str, list[int]] = {}
    for i, value in enumerate(strata):
        groups.setdefault(value, []).append(i)
    cycle = sorted(groups)
    rng.shuffle(cycle)
    for value in cycle:
        rng.shuffle(groups[value])
    out: list[int] = []
    while len(out) < len(strata):
        out.extend(groups[value].pop() for value in cycle if groups[value])
    return out


def handle_alerts(run: Run, line: dict[str, Any]) -> bool:
    """Run the detectors on this step's line; warn, stop, or roll back to the peak. True: stop."""
    p = run.progress
    alerts = run.detectors.update(p.step, line)
    stop = False
    for alert in alerts:
        record = alert.to_dict()
        if alert.action == "rollback":
            record["rolled_back_to"] = checkpoint.rollback(run, alert.on_rollback)  # peak weights, new config, new optimizer
            if record["rolled_back_to"] is not None:
                line[M.ALERT_ROLLBACK] = 1.0
                record["config_now"] = {k: get_key(run.cfg, k) for k in alert.on_rollback}
                p.config_changes.update(record["config_now"])
        elif alert.action == "stop":
            stop = True
        if run.ctx.is_main:
            append_jsonl(run.run_dir / "alerts.jsonl", record)
        p.alerts_lines += 1
        say(run, f"[keel] step {p.step} ALERT {alert.kind}: {alert.suggested_action} (action: {alert.action})")
    line[M.ALERT_COUNT] = float(len(alerts))
    return stop


def finish(run: Run, interrupted: bool = False) -> dict[str, Any]:
    """Write summary.json and the report; returns the summary."""
    p = run.progress
    s = p.summary
    # the final evaluation of a finished run; an interrupted one has none yet (not the pre-SFT one)
    s["eval_final"] = None if interrupted else p.last_eval if p.last_eval is not None else s.get("eval_after_sft") or s.get("eval_before_sft")
    s["peak"] = p.peak if p.peak["step"] is not None else None
    s["steps"] = p.step
    s["grpo_steps_done"] = p.rl_done
    s["phase"] = p.phase
    s["interrupted"] = interrupted
    s["interrupted_by"] = run.interrupted.signal_name if interrupted else None  # SIGINT | SIGTERM
    s["precision"] = {"rollout.dtype": run.cfg.rollout.dtype, "model.autocast": run.cfg.model.autocast}  # as run (resolve_precision), this segment
    lift = rl_lift(run) if run.ctx.is_main else None
    if lift is not None:
        s.update(lift)
    s["wall_time_s"] = s.get("wall_time_s", 0.0) + (time.time() - run.t_start)
    if run.ctx.enabled:
        s["processes"] = run.ctx.world_size
    if run.ctx.is_main:
        atomic_write_json(run.run_dir / "summary.json", s)
    refresh_report(run)
    if interrupted:
        say(run, f"[keel] stopped cleanly at step {p.step}; continue with: keel train --resume {run.run_dir}")
    elif lift is not None:
        say(run, f"[keel] RL lifted dev EM {lift[M.RL_LIFT_EM_AFTER_SFT]:.2f} → {lift[M.RL_LIFT_EM_FINAL]:.2f} "
                 f"({lift[M.RL_LIFT_EM]:+.2f}, McNemar p={lift[M.RL_LIFT_P_VALUE]:.3g}, n={lift[M.RL_LIFT_N]}; "
                 f"{lift[M.RL_LIFT_GAINED]} questions gained, {lift[M.RL_LIFT_LOST]} lost)")
    barrier(run.ctx)
    return s


def rl_lift(run: Run) -> dict[str, Any] | None:
    """What the RL phase did: the final evaluation against the post-SFT one — or, when the run
    has no SFT phase (RL from a checkpoint), against its first evaluation (`eval.before_sft`) —
    paired per dev question (the final checkpoint, not the peak: no selection on the set
    reported), with an exact McNemar test. None without both evaluations or without RL steps."""
    from keel.compare import paired_lift, read_eval

    p = run.progress
    start = p.summary.get("eval_after_sft_step", p.summary.get("eval_before_sft_step"))  # the eval RL started from
    if start is None or p.last_eval is None or p.rl_done == 0:
        return None
    final = sorted((run.run_dir / "eval").glob("step_*.jsonl"))[-1]  # zero-padded names: the last is the latest
    try:
        lift = paired_lift(read_eval(run.run_dir / "eval" / f"step_{start:06d}.jsonl"), read_eval(final))
    except (OSError, ValueError) as exc:  # a summary line must not crash the end of a finished run
        say(run, f"[keel] warning: RL lift not computed: {exc}")
        return None
    return {M.RL_LIFT_EM: lift["lift"], M.RL_LIFT_P_VALUE: lift["p_value"], M.RL_LIFT_N: lift["n"], M.RL_LIFT_GAINED: lift["gained"],
            M.RL_LIFT_LOST: lift["lost"], M.RL_LIFT_EM_AFTER_SFT: lift["before"], M.RL_LIFT_EM_FINAL: lift["after"]}
