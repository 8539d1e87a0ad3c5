"""`rollout.dtype: auto` and `model.autocast: auto`: bf16 only where the device multiplies bf16
natively (keel.models.native_bf16), decided when the run starts, recorded in summary.json."""

import json

import pytest
import torch
import yaml

from keel import models
from keel.config import Config, ConfigError, load_config
from keel.run import resolve_precision
from runs import train_cli


def _auto() -> Config:
    cfg = Config()
    cfg.rollout.dtype, cfg.model.autocast = "auto", "auto"
    return cfg


@pytest.mark.parametrize("native, dtype, autocast, words", [(True, "bfloat16", True, "multiplies bf16 natively"),
                                                           (False, "float32", False, "no native bf16 matmul")])
def test_auto_follows_the_device(monkeypatch, native, dtype, autocast, words):
    monkeypatch.setattr("keel.run.native_bf16", lambda device: native)
    cfg = _auto()
    got, said = resolve_precision(cfg, "cpu")
    assert (got.rollout.dtype, got.model.autocast) == (dtype, autocast)
    assert words in said and "rollout.dtype and model.autocast auto" in said
    assert (cfg.rollout.dtype, cfg.model.autocast) == ("auto", "auto")  # the caller's config (config.yaml's) keeps auto


def test_explicit_settings_are_never_changed(monkeypatch):
    monkeypatch.setattr("keel.run.native_bf16", lambda device: False)
    cfg = Config()
    cfg.rollout.dtype, cfg.model.autocast = "bfloat16", True
    got, said = resolve_precision(cfg, "cpu")
    assert got is cfg and said == "" and (got.rollout.dtype, got.model.autocast) == ("bfloat16", True)
    cfg.rollout.dtype = "auto"  # one auto key: only it is decided
    got, said = resolve_precision(cfg, "cpu")
    assert (got.rollout.dtype, got.model.autocast) == ("float32", True) and said.startswith("rollout.dtype auto")


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert models.native_bf16("cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(models.platform, "machine", lambda: "x86_64")
    assert not models.native_bf16("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert models.native_bf16("cpu")
    assert not models.native_bf16("mps")


@pytest.mark.parametrize("override", ["model.autocast=maybe", "model.autocast=1", "rollout.dtype=half"])
def test_precision_values_are_checked(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key):
        load_config("configs/smoke.yaml", [override])


def test_a_run_records_what_auto_decided(tmp_path):
    out = train_cli(tmp_path, "run", "configs/smoke.yaml", "--set", "rollout.dtype=auto", "--set", "model.autocast=auto")
    native = models.native_bf16("cpu")  # the run's machine is this one
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == {"rollout.dtype": "bfloat16" if native else "float32", "model.autocast": native}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["rollout"]["dtype"], saved["model"]["autocast"]) == ("auto", "auto")


def test_the_autocast_reference_gives_the_fp32_copys_logprobs_bit_for_bit(tiny):
    """keel.models.frozen_reference: under bf16 autocast its Linear weights (LM head untied) are
    stored as the bf16 values autocast would cast them to, so its log-probs equal the fp32
    frozen copy's exactly, at half the memory of those weights; without autocast it is the copy."""
    from keel.logprobs import token_logprobs

    model, tok = tiny
    ids = torch.randint(5, 1000, (2, 30), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    tmask = torch.ones_like(ids, dtype=torch.bool)
    tmask[:, 0] = False
    plain = models.frozen_copy(model)
    ref = models.frozen_reference(model, autocast=True)
    linears = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert ref.get_input_embeddings().weight.dtype == torch.float32 and ref.get_output_embeddings().weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in ref.named_parameters() if "norm" in n)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = token_logprobs(plain, ids, attn, tmask, temperature=0.7)
        got, _ = token_logprobs(ref, ids, attn, tmask, temperature=0.7)
    assert torch.equal(want, got)
    layers = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "layers." in n and "norm" not in n)  # noqa: E731
    assert 2 * layers(ref) == layers(plain)  # the decoder's linears at half the bytes
    fp32 = models.frozen_reference(model, autocast=False)
    assert all(p.dtype == torch.float32 for p in fp32.parameters()) and not any(p.requires_grad for p in fp32.parameters())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # the policy itself is untouched


def test_a_released_sampler_is_refilled_by_copy_weights(tiny):
    """The sampler copy's weights are freed for the update (keel.models.release_weights) and
    copy_weights allocates and fills them again: the same weights as a sampler never released."""
    model, _ = tiny
    kept = models.frozen_copy(model, torch.bfloat16)
    sampler = models.frozen_copy(model, torch.bfloat16)
    models.release_weights(sampler, model)
    assert all(p.numel() == 0 for p in sampler.parameters())
    models.copy_weights(sampler, model)
    models.copy_weights(kept, model)
    for (n, a), (_, b) in zip(sampler.named_parameters(), kept.named_parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), n
    models.release_weights(model, model)  # one model: nothing is freed
    assert all(p.numel() > 0 for p in model.parameters())


def test_the_reference_rebuilt_on_resume_loads_the_saved_weights_before_untying_its_head(tiny):
    """On resume (keel.checkpoint.restore) the reference is the saved state loaded into a copy of
    the current policy, then made the autocast reference: its untied bf16 head must come from
    the saved embeddings, not from the policy's current ones."""
    import copy

    model, _ = tiny
    saved = copy.deepcopy(model)
    policy = copy.deepcopy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)  # the policy moved on after the reference was saved
    rebuilt = models.frozen_reference(policy, autocast=True, state=saved.state_dict())
    want = models.frozen_reference(saved, autocast=True)
    for (n, a), (_, b) in zip(rebuilt.named_parameters(), want.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), n


def test_optim_lr_is_the_rate_each_update_used(tmp_path):
    # A linear warm-up over 2 steps: the first update of each phase runs at half the rate, the
    # second at the full rate (the scheduler moves on after the update; optim/lr once logged the
    # next step's rate, so a warm-up looked one step further along than it was).
    out = train_cli(tmp_path, "run", "configs/smoke.yaml", "--set", "sft.lr=1e-4", "--set", "sft.warmup_steps=2",
                    "--set", "grpo.lr=1e-5", "--set", "grpo.warmup_steps=2")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [(d["phase"], d["optim/lr"]) for d in lines if "optim/lr" in d]
    assert lrs == [("sft", pytest.approx(5e-5)), ("sft", pytest.approx(1e-4)), ("rl", pytest.approx(5e-6)), ("rl", pytest.approx(1e-5))]


def test_adamw_runs_fused_on_cpu_and_moves_the_weights_as_the_default_implementation():
    """keel.models.adamw: torch's fused AdamW on CPU; six steps on the same gradients land within
    rounding of the default (for-loop) AdamW's weights, and every weight moved by about lr."""
    from keel.models import adamw

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=g) * 0.02 for shape in ((64, 48), (48,), (7, 5, 3))]
    signs = [torch.randn(p.shape, generator=g).sign() for p in start]
    grads = [[s * torch.rand(s.shape, generator=g) * 1e-3 for s in signs] for _ in range(6)]  # one direction a weight

    def train(make):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = make(params)
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
        return opt, [p.detach() for p in params]

    fused, got = train(lambda ps: adamw(ps, lr=1e-3, weight_decay=0.01, eps=1e-8))
    plain, want = train(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, eps=1e-8))
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    for a, b, p0 in zip(got, want, start):
        assert torch.allclose(a, b, rtol=0, atol=1e-8)
        assert (a - p0).abs().min() > 3e-3  # six steps of ~lr each, one way: every weight moved
