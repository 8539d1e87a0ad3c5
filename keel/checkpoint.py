"""Checkpoints, resume and rollback: what a run writes so that `keel train --resume` continues it
exactly, and what a rollback alert loads.

    checkpoints/latest     policy weights, optimizer, scheduler, RNG states, detectors, the
                           signals' state, Progress (every `run.checkpoint_every` steps, at eval
                           steps, on a stop or an interrupt, at the end)
    checkpoints/reference  the KL reference: the policy as RL starts (once)
    checkpoints/peak       the policy at the best dev EM so far (what a rollback alert loads)

Each is written into a temp directory and swapped in; trainer_state.json is written last, so its
presence marks a complete checkpoint. A LoRA policy is saved merged (a plain model for `keel
eval`) plus its adapter weights (what resume and rollback load).

`save`, `save_latest`, `resume`, `restore` and `rollback` take the run's state (keel.run.Run; this module
reads its attributes and does not import it: keel.run imports Progress from here).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from keel import metrics as M
from keel.config import get_key, set_key
from keel.distributed import DistContext, barrier, broadcast_object
from keel.models import copy_weights, frozen_reference, make_optimizer
from keel.rundir import atomic_write_json, swap_dir, truncate_jsonl_lines


@dataclass
class Progress:
    """Everything besides tensors that a resumed run needs to continue exactly (saved as JSON)."""

    step: int = 0  # global step: SFT steps, then RL steps
    phase: str = "start"  # start → sft → rl → done
    sft_done: int = 0
    rl_done: int = 0
    sft_order: list[int] = field(default_factory=list)  # remaining example indices of the current SFT epoch
    rl_order: list[int] = field(default_factory=list)  # remaining task indices of the current RL epoch
    peak: dict[str, Any] = field(default_factory=lambda: {"step": None, M.EVAL_EM: -1.0})
    last_eval: dict[str, float] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    metrics_lines: int = 0  # lines of metrics.jsonl / alerts.jsonl covered by this state
    alerts_lines: int = 0
    config_changes: dict[str, Any] = field(default_factory=dict)  # applied by rollback alerts
    signals: dict[str, Any] = field(default_factory=dict)  # ETS buffer and hint-policy state


def save_checkpoint(path: Path, model, tokenizer, optimizer, state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write into a temp dir and swap it in: a kill mid-write leaves the previous one intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / name)
        atomic_write_json(tmp / "trainer_state.json", state)  # written last: its presence marks a complete checkpoint
    except Exception as exc:  # a full disk: say so (safetensors and torch.save do not), free the partial copy
        from keel.rundir import disk_full

        full = disk_full(exc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from None
        raise
    swap_dir(tmp, path)


def complete_checkpoint(path: Path) -> Path | None:
    """The usable checkpoint at `path`: itself if complete (trainer_state.json is written last),
    else the `.old` copy a kill between swap_dir's two renames leaves behind (moved back)."""
    if (path / "trainer_state.json").exists():
        return path
    old = path.with_name(path.name + ".old")
    if (old / "trainer_state.json").exists():
        if path.exists():
            shutil.rmtree(path)
        os.replace(old, path)
        return path
    return None


def save(run, name: str, model, optimizer, state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """checkpoints/<name>, written by rank 0; every rank waits until it is complete. A LoRA
    policy is saved merged (a plain model for `keel eval`) plus its adapter weights."""
    if run.ctx.is_main and run.lora is not None and model is run.model:
        model = run.lora.merged_model()
        extra = {**(extra or {}), "adapter.pt": run.lora.adapter_state()}
    if run.ctx.is_main:
        save_checkpoint(run.run_dir / "checkpoints" / name, model, run.tok, optimizer, state, extra)
    barrier(run.ctx)


def save_latest(run) -> None:
    """checkpoints/latest: weights, optimizer, scheduler, RNG states, detectors, signals, progress."""
    if not run.cfg.run.save_checkpoints:
        return
    p = run.progress
    signals = run.signals.state_dict()
    p.signals = {k: v for k, v in signals.items() if k != "reflections"}  # the reflection pool goes to reflections.pt
    state = {
        "progress": asdict(p),
        "rng": _rng_to_json(run.rng.getstate()),
        "detectors": run.detectors.state_dict(),
        "freq_baseline": run.freq_baseline.state_dict(),
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "step": p.step,
    }
    extra = {"torch_rng.pt": torch.get_rng_state(), "reflections.pt": signals["reflections"]}
    save(run, "latest", run.model, run.optimizer, state, extra)


def resume(run) -> None:
    """`keel train --resume`: continue `run` from checkpoints/latest (rank 0 decides, and mends a
    half-swapped one), or, killed before its first checkpoint was complete, start it over from
    step 0 in the same directory. Says which on the console."""
    has_checkpoint = complete_checkpoint(run.run_dir / "checkpoints" / "latest") is not None if run.ctx.is_main else None
    if broadcast_object(has_checkpoint, run.ctx):
        restore(run)
        message = f"[keel] resumed {run.run_dir} at step {run.progress.step} ({run.progress.phase})"
    else:
        restart(run.run_dir, run.ctx)
        message = f"[keel] {run.run_dir} has no complete checkpoint yet: starting it again from step 0"
    if run.ctx.is_main:
        print(message, flush=True)


def restore(run) -> None:
    """Load checkpoints/latest into `run` (a fresh run's objects) and cut metrics/alerts back to
    what it covers. The reference and the optimizer of the phase it was in are rebuilt."""
    from safetensors.torch import load_file

    ck = complete_checkpoint(run.run_dir / "checkpoints" / "latest")
    state = json.loads((ck / "trainer_state.json").read_text())
    run.progress = Progress(**state["progress"])
    for key, value in run.progress.config_changes.items():
        set_key(run.cfg, key, value)
    if run.lora is not None:
        run.lora.load_adapter_state(torch.load(ck / "adapter.pt"))
    else:
        run.model.load_state_dict(load_file(str(ck / "model.safetensors")), strict=False)
    run.rng.setstate(_rng_from_json(state["rng"]))
    torch.set_rng_state(torch.load(ck / "torch_rng.pt"))
    run.detectors.load_state_dict(state["detectors"])
    run.freq_baseline.load_state_dict(state["freq_baseline"])
    signals = dict(run.progress.signals)
    if (ck / "reflections.pt").exists():
        signals["reflections"] = torch.load(ck / "reflections.pt")
    run.signals.load_state_dict(signals)
    g = run.cfg.grpo
    if run.progress.phase in ("rl", "done"):
        reference = load_file(str(run.run_dir / "checkpoints" / "reference" / "model.safetensors"))
        if run.lora is not None:  # base weights = the SFT model folded at the RL start; adapters on top
            run.lora.load_base_state(reference)
            run.ref_model = run.lora
        else:
            run.ref_model = frozen_reference(run.model, run.cfg.model.autocast, state=reference)
        run.optimizer, run.scheduler = make_optimizer(run.model, g.lr, g.warmup_steps, g.weight_decay, g.adam_eps)
    else:
        run.optimizer, run.scheduler = make_optimizer(run.model, run.cfg.sft.lr, run.cfg.sft.warmup_steps, 0.0, g.adam_eps)
    copy_weights(run.sampler, run.model)
    if (ck / "optimizer.pt").exists():
        run.optimizer.load_state_dict(torch.load(ck / "optimizer.pt"))
    if state.get("scheduler"):
        run.scheduler.load_state_dict(state["scheduler"])
    if run.ctx.is_main:
        truncate_jsonl_lines(run.run_dir / "metrics.jsonl", run.progress.metrics_lines)
        truncate_jsonl_lines(run.run_dir / "alerts.jsonl", run.progress.alerts_lines)
    barrier(run.ctx)


def restart(run_dir: Path, ctx: DistContext) -> None:
    """Resume of a run killed before any complete checkpoint: nothing trained is lost, so the
    run starts again from step 0 (same config, same seed) over what the killed process left."""
    if ctx.is_main:
        for name in ("checkpoints", "samples", "eval"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        truncate_jsonl_lines(run_dir / "metrics.jsonl", 0)
        truncate_jsonl_lines(run_dir / "alerts.jsonl", 0)
    barrier(ctx)


def rollback(run, overrides: dict[str, str]) -> int | None:
    """Load the `peak` checkpoint's weights, apply the alert's config changes ("x5" multiplies)
    and start a fresh optimizer (no warm-up) for RL from there.

    Returns the peak's step, or None when there is no peak yet (nothing changes; the alert is
    then only logged).
    """
    from safetensors.torch import load_file

    peak = run.run_dir / "checkpoints" / "peak"
    if not (peak / "model.safetensors").exists():
        return None
    if run.lora is not None:
        run.lora.load_adapter_state(torch.load(peak / "adapter.pt"))
    else:
        run.model.load_state_dict(load_file(str(peak / "model.safetensors")), strict=False)  # tied lm_head is not stored separately
    for key, value in overrides.items():
        current = get_key(run.cfg, key)
        if isinstance(value, str) and value.startswith("x") and isinstance(current, (int, float)):
            set_key(run.cfg, key, float(current) * float(value[1:]))
        else:
            import yaml

            set_key(run.cfg, key, yaml.safe_load(value) if isinstance(value, str) else value)
    step = int(json.loads((peak / "trainer_state.json").read_text())["step"])
    copy_weights(run.sampler, run.model)
    g = run.cfg.grpo
    run.optimizer, run.scheduler = make_optimizer(run.model, g.lr, 0, g.weight_decay, g.adam_eps)
    return step


def _rng_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(state) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
