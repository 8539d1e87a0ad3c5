"""LoRA training (`model.lora_rank > 0`): only adapters train, the reference is the SFT model
with adapters off (no copy), checkpoints hold a plain merged model plus the adapters, and a
resumed LoRA run continues exactly."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runs import assert_same_lines, deterministic_lines

pytest.importorskip("peft")  # the `lora` extra; installed by the dev extra that .ci/run uses

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["configs/smoke.yaml", "--set", "signals.ops.enabled=true", "--set", "signals.ops.mode=replace", "--set", "signals.ops.members=1",
        "--set", "run.progress=false", "--set", "model.lora_rank=4", "--set", "model.lora_alpha=8",
        "--set", "sft.enabled=true", "--set", "sft.steps=2", "--set", "sft.lr=1e-2", "--set", "grpo.lr=1e-2", "--set", "eval.every=1",
        "--set", "grpo.kl_coef=0.1"]


def _train(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keel.cli", "train", *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)


def test_fold_keeps_the_function_and_makes_it_the_adapters_off_model(tiny):
    from keel.models import LoRA

    model, _ = tiny
    lora = LoRA(copy.deepcopy(model), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in lora.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter (B starts at zero)
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = lora.model(input_ids=ids).logits
        with lora.reference():
            base = lora.model(input_ids=ids).logits
        assert (before - base).abs().max() > 1e-3  # the adapter changes the function
        lora.fold()
        after = lora.model(input_ids=ids).logits
        with lora.reference():
            off = lora.model(input_ids=ids).logits
    assert torch.allclose(after, before, atol=1e-5)
    assert torch.allclose(off, before, atol=1e-5)  # adapters off = the folded model


def test_lora_run_trains_adapters_and_saves_a_plain_model(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from keel.models import load_model

    run = tmp_path / "run"
    r = _train(*ARGS, "--set", "grpo.steps=2", "--out", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = deterministic_lines(run)
    assert [d["phase"] for d in lines] == ["eval", "sft", "sft", "eval", "rl", "rl"]
    assert lines[-1]["kl/k3_mean"] > 0  # policy (adapters on) vs reference (adapters off) differ after an RL step

    initial, _ = load_model("tiny", seed=0)
    plain = LlamaForCausalLM(initial.config)
    for name in ("latest", "reference", "peak"):
        ck = run / "checkpoints" / name
        state = load_file(str(ck / "model.safetensors"))
        missing, unexpected = plain.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (name, unexpected, missing)  # a plain model
        assert (ck / "adapter.pt").exists()
    latest = load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))
    reference = load_file(str(run / "checkpoints" / "reference" / "model.safetensors"))
    start = initial.state_dict()
    sft_moved = max((reference[k] - start[k]).abs().max().item() for k in reference)
    rl_moved = max((latest[k] - reference[k]).abs().max().item() for k in latest)
    assert sft_moved > 1e-4 and rl_moved > 1e-4, (sft_moved, rl_moved)
    # embeddings and norms are not adapted: identical to the initial model throughout
    for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(latest[k], start[k]), k


def test_resumed_lora_run_continues_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = _train(*ARGS, "--set", "grpo.steps=3", "--out", str(straight))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train(*ARGS, "--set", "grpo.steps=2", "--out", str(resumed))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train("--resume", str(resumed), "--set", "grpo.steps=3")
    assert r.returncode == 0, r.stderr[-2000:]
    expected, got = deterministic_lines(straight), deterministic_lines(resumed)
    assert len(expected) == 7
    assert_same_lines(got, expected)
