"""keel.native's kernels (keel/decode_ops.c) against the torch ops they replace: exact where the
same roundings give the same bits (rotary, the residual add), within a rounding of the dtype
elsewhere (different summation order or exp); and whole decode steps and rollouts against the
same decoder on torch ops."""

import logging
import math

import pytest
import torch

import keel.decode as decode
import keel.native as native
import keel.rollout as engine
from fakes import EchoEnv, make_tasks
from keel.rollout import SamplingParams, rollout

LIB = native.ops()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler here: keel.decode runs torch ops")
DTYPES = [torch.float32, torch.bfloat16]


def _within_rounding(a: torch.Tensor, b: torch.Tensor, ulps: float = 1.0):
    """a and b in their dtype differ by at most `ulps` units in the last place of the larger."""
    eps = torch.finfo(a.dtype).eps  # bf16 2^-7, fp32 2^-23
    a, b = a.double(), b.double()
    bound = ulps * eps * torch.maximum(a.abs(), b.abs()) + 1e-30
    assert ((a - b).abs() <= bound).all(), ((a - b).abs() / bound).max().item()


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_transformers(dtype):
    torch.manual_seed(0)
    h, delta = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    nat, ref = decode._NativeOps(LIB, 1e-5, dtype), decode._TorchOps(1e-5)
    h_ref, x_ref = ref.norm(h, delta, weight)
    h_nat, x_nat = nat.norm(h.clone(), delta, weight)
    assert torch.equal(h_nat, h_ref)  # the residual add: one rounding either way
    _within_rounding(x_nat, x_ref)
    _, x0 = nat.norm(h.clone(), None, weight)
    _within_rounding(x0, ref.norm(h, None, weight)[1])


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_exact(dtype):
    torch.manual_seed(1)
    H, KV, D = 4, 2, 64
    qkv = torch.randn(3, (H + 2 * KV) * D).to(dtype)
    angle = torch.rand(3, D // 2) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    expect = decode._TorchOps(1e-5).rotary(qkv.clone(), cos, sin, H, KV, D)
    got = decode._NativeOps(LIB, 1e-5, dtype).rotary(qkv.clone(), cos, sin, H, KV, D)
    for a, b in zip(got, expect):
        assert torch.equal(a, b)


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_torch(dtype):
    torch.manual_seed(2)
    gu = (4 * torch.randn(6, 2 * 80)).to(dtype)
    got = decode._NativeOps(LIB, 1e-5, dtype).swiglu(gu, 80)
    expect = decode._TorchOps(1e-5).swiglu(gu, 80)
    _within_rounding(got, expect, ulps=2 if dtype == torch.float32 else 1)


def _attention_reference(q, pk, pv, keys, values, visible, scale, magnitude: bool = False):
    """float64 attention of q [B, H, D] over [prefix ‖ own keys], own keys masked by visible [B, L]
    (`magnitude`: the same weights over |values|, the scale of the sum's rounding errors)."""
    B, H, D = q.shape
    KV = keys.shape[1]
    rep = H // KV
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            g = h // rep
            k_all = [keys[b, g][visible[b]].double()]
            v_all = [values[b, g][visible[b]].double()]
            if pk is not None:
                k_all.insert(0, pk[0, g].double())
                v_all.insert(0, pv[0, g].double())
            k, v = torch.cat(k_all), torch.cat(v_all)
            w = torch.softmax(k @ q[b, h].double() * scale, dim=0)
            out[b, h] = w @ (v.abs() if magnitude else v)
    return out


class _Layer:
    def __init__(self, prefix):
        self.prefix = prefix


BF16_KERNELS = native.bf16_kernels(LIB)
# (dtype, attention kernel): the prefix-in-fp32 kernel for both dtypes, the bf16 ones where the CPU has them
KERNELS = [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
           pytest.param(torch.bfloat16, "amx", marks=pytest.mark.skipif("amx" not in BF16_KERNELS, reason="no AMX on this CPU")),
           pytest.param(torch.bfloat16, "dpbf16",
                        marks=pytest.mark.skipif("dpbf16" not in BF16_KERNELS, reason="no AVX512-BF16 on this CPU"))]


@needs_lib
@pytest.mark.parametrize(("dtype", "kernel"), KERNELS)
@pytest.mark.parametrize("shape", [(5, 6, 2, 64, 37, 21), (3, 8, 8, 32, 0, 19), (2, 4, 1, 128, 16, 1), (20, 9, 3, 64, 45, 33)])
def test_attention_matches_a_float64_reference(dtype, kernel, shape):
    """Grouped heads, a shared prefix that is not a multiple of 16 (or 32) long (or none), the rows'
    own keys in a strided growing buffer with holes in their mask, an idle row (its newest key
    hidden: the kernels skip its own keys, so its output is the prefix's attention alone, zero
    without a prefix); the last shape has several 16-row tiles of queries for the AMX kernel and
    own keys that end inside a 16-key block."""
    B, H, KV, D, P, L = shape
    torch.manual_seed(3)
    qkv = torch.randn(B, (H + 2 * KV) * D).to(dtype)
    q = qkv[:, : H * D].view(B, H, D)
    kbuf, vbuf = torch.randn(B, KV, L + 7, D).to(dtype), torch.randn(B, KV, L + 7, D).to(dtype)
    keys, values = kbuf[:, :, :L], vbuf[:, :, :L]
    prefix = (torch.randn(1, KV, P, D).to(dtype), torch.randn(1, KV, P, D).to(dtype)) if P else None
    attn = torch.ones(B, P + L, dtype=torch.long)
    attn[0, P + 1 : P + L // 2] = 0  # a hole in row 0's own keys
    if L > 1:
        attn[-1, P : P + L - 1] = 0  # the last row sees only its newest own key
    if B >= 3:
        attn[1, P + L - 1] = 0  # row 1 is idle: its own keys are not read, though some are visible
    visible = attn[:, P:].bool()
    idle = ~visible[:, -1]
    visible[idle] = False
    scale = D**-0.5
    ops = decode._NativeOps(LIB, 1e-5, dtype, kernel=kernel)
    assert ops.kernel == kernel
    got = ops.attend(0, q, _Layer(prefix), keys, values, ops.prepare(attn, P, H, KV, dtype, D), scale).view(B, H, D)
    expect = _attention_reference(q, *(prefix or (None, None)), keys, values, visible, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expect, atol=2e-6, rtol=1e-5)
    else:
        # inputs are exact; the output is rounded once to bf16 (unit roundoff 2^-8), the sum of p·v
        # has fp32 errors (2^-16 of Σ p·|v| bounds them) or, in the bf16 kernels, the prefix's
        # probabilities rounded to bf16 before their product with the values (2^-8 each)
        size = _attention_reference(q, *(prefix or (None, None)), keys, values, visible, scale, magnitude=True)
        bound = 2.0**-8 * expect.abs() + (2.0**-8 if kernel != "fp32" and P else 2.0**-16) * size
        err = (got.double() - expect).abs()
        assert (err <= bound).all(), (err / bound).max()
    torch_ops = decode._TorchOps(1e-5)
    on_torch = torch_ops.attend(0, q, _Layer(prefix), keys, values, torch_ops.prepare(attn, P, H, KV, dtype, D), scale).view(B, H, D)
    busy = ~idle  # the torch ops attend idle rows as their mask says (the decode step discards those rows either way)
    assert (got[busy].double() - expect[busy]).abs().max() <= (on_torch[busy].double() - expect[busy]).abs().max() + 1e-6


@needs_lib
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_sampling_matches_the_torch_inverse_cdf(temperature, monkeypatch):
    torch.manual_seed(4)
    logits = 3 * torch.randn(6, 1003)
    logits[2, 500:] = float("-inf")  # a row with half its vocabulary masked
    params = SamplingParams(temperature=temperature if temperature else 1.0, greedy=temperature == 0.0)
    tok, logp = engine._choose(logits, params, torch.Generator().manual_seed(5))
    monkeypatch.setattr(native, "ops", lambda: None)
    tok_ref, logp_ref = engine._choose(logits, params, torch.Generator().manual_seed(5))
    assert torch.equal(tok, tok_ref)
    torch.testing.assert_close(logp, logp_ref, atol=2e-6, rtol=0)
    assert tok[2] < 500


@needs_lib
def test_sampling_ties_nans_and_inactive_rows():
    """Greedy picks the first of tied maxima (torch.argmax's rule; also in the 7 tokens past the
    last block of 16), NaNs never win, and rows marked inactive are not sampled."""
    logits = torch.zeros(5, 1003)
    logits[0, [40, 700, 900]] = 5.0  # tied maxima: 40
    logits[1, [999, 1001]] = 5.0  # only in the tail past 992: 999
    logits[2, 17] = float("nan")
    logits[2, 600] = 1.0  # 600, not the NaN
    logits[3, 3] = 9.0
    logits[4, 8] = 9.0
    greedy = SamplingParams(greedy=True)
    tok, logp = engine._choose(logits, greedy, None)
    assert tok.tolist() == [40, 999, 600, 3, 8]
    tok, logp = engine._choose(logits, greedy, None, active=[True, True, True, False, True])
    assert tok.tolist() == [40, 999, 600, 0, 8] and logp[3].item() == 0.0
    assert logp[4].item() == pytest.approx(-torch.logsumexp(logits[4].double() - 9.0, 0).item(), rel=1e-4)  # fp32 sum of 1003 terms


def _gqa_model(dtype):
    """A tiny random Llama whose head dim (32) the kernels serve (the suite's tiny model has 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).to(dtype).eval()


def _greedy_episodes(model, tok):
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    params = SamplingParams(max_turns=3, max_new_tokens=20, greedy=True)
    return rollout(model, tok, EchoEnv(lengths=(1, 7, 3, 12)), make_tasks(5), params,
                   steer=lambda row, turn: call if turn < row % 3 else None)


@needs_lib
def test_rollouts_on_the_kernels_match_rollouts_on_torch_ops(tiny, monkeypatch):
    """fp32 multi-turn ragged rollouts with a shared prefix: the same greedy tokens, log-probs
    within 1e-5. (In bf16 a greedy argmax near-tie can go either way once the last bits of the
    logits differ, so bf16 is compared step by step below.)"""
    model = _gqa_model(torch.float32)
    assert isinstance(decode.LeanDecoder.build(model).ops, decode._NativeOps)
    on_kernels = _greedy_episodes(model, tiny[1])
    monkeypatch.setattr(native, "ops", lambda: None)
    assert isinstance(decode.LeanDecoder.build(model).ops, decode._TorchOps)
    on_torch = _greedy_episodes(model, tiny[1])
    assert [t.token_ids for t in on_kernels] == [t.token_ids for t in on_torch]
    diff = max(abs(x - y) for a, b in zip(on_kernels, on_torch) for x, y in zip(a.logprobs, b.logprobs))
    assert diff <= 1e-5, diff
    assert sum(t.num_policy_tokens for t in on_kernels) > 40


PROMPTS = ("You can call tools. " * 8 + "Who?", "You can call tools. " * 8 + "Where was it born?", "You can call tools. " * 8 + "Why not")


PROMPTS_APART = ("Who?", "Where was it born? " * 3, "Why not " * 5)  # no shared prefix: left-padded, no cascade


def _decode_steps(model, tok, steps: int, next_tokens, torch_ops: bool = False, shared: bool = True):
    """(logits [steps, 3, V], the cache) of `steps` decode steps after prefilling PROMPTS (a shared
    prefix, ragged questions), or PROMPTS_APART one by one into a left-padded cache without a
    prefix (`shared` False); `next_tokens(logits [3, V])` gives each step's input ids [3, 1]."""
    prompts = [tok.encode(p, add_special_tokens=False) for p in (PROMPTS if shared else PROMPTS_APART)]
    with torch.no_grad(), engine._cascade_attention(model, True):
        if shared:
            first, cache, attn = engine._prefill(model, prompts, torch.device("cpu"))
        else:
            first, cache, attn = engine._prefill_each(model, prompts, torch.device("cpu"))
        assert (cache.layers[0].prefix is not None) == shared  # the attention's shared-prefix path, or not
        decoder = decode.LeanDecoder.build(model)
        assert isinstance(decoder.ops, decode._NativeOps)
        if torch_ops:
            decoder.ops = decode._TorchOps(decoder.eps)
        positions = attn.sum(1, keepdim=True) - 1
        tokens, out = first.argmax(-1, keepdim=True), []
        for _ in range(steps):
            attn = torch.cat([attn, torch.ones(len(prompts), 1, dtype=attn.dtype)], dim=1)
            positions = positions + 1
            out.append(decoder.step(tokens, attn, positions, cache))
            tokens = next_tokens(out[-1])
    return torch.stack(out), cache


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_on_the_kernels_match_torch_ops(tiny, dtype):
    """Three decode steps from the same prefilled cache (shared prefix, ragged questions), on the
    kernels and on torch ops: logits within 2e-6 (fp32; 3e-7 measured) or 0.03 (bf16: four units
    in the last place of the logits here, which span about ±1.5; one unit measured, with the AMX
    attention kernel as without)."""
    model = _gqa_model(dtype)

    def fixed(logits):  # both sides see the same ids
        return torch.tensor([[7], [8], [9]])

    logits = {name: _decode_steps(model, tiny[1], 3, fixed, torch_ops=name == "torch")[0] for name in ("kernels", "torch")}
    assert logits["kernels"].shape == logits["torch"].shape == (3, len(PROMPTS), model.config.vocab_size)
    torch.testing.assert_close(logits["kernels"], logits["torch"], atol=2e-6 if dtype == torch.float32 else 0.03, rtol=0)


def _greedy_run(model, tok, shared: bool = True):
    """300 greedy decode steps (`_decode_steps`): (logits, each layer's keys and values)."""
    logits, cache = _decode_steps(model, tok, 300, lambda step: step.argmax(-1, keepdim=True), shared=shared)
    return logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _assert_same_run(a, b):
    """Two `_greedy_run`s: bit-equal logits and caches, each cache past its first capacity."""
    assert torch.equal(a[0], b[0])
    for (k1, v1), (k2, v2) in zip(a[1], b[1]):
        assert k1.shape == k2.shape and k1.shape[-2] > 300
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@needs_lib
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_in_place_append_gives_the_steps_of_the_cache_update(tiny, dtype, monkeypatch):
    """The native step appends keys and values straight from the q/k/v GEMM's output into the
    cache's buffers (`rotary_attend`, `_GrowingLayer.columns`); with `columns` refused, the same
    kernels go through `layer.update`. 300 steps (past the buffers' first capacity of 256, where
    the in-place path hands over to `update` to grow them): bit-equal logits and caches."""
    monkeypatch.setenv("KEEL_FUSED_STEP", "0")  # the per-layer loop, whose appends this compares (the fused one: below)
    model = _gqa_model(dtype)
    real_columns = engine._growing_layer_class().columns
    used = {"in place": 0, "update": 0}

    def counted(layer, new, free=None):
        got = real_columns(layer, new, free)
        used["in place" if got is not None else "update"] += 1
        return got

    runs = {}
    for name in ("in place", "update"):
        monkeypatch.setattr(engine._growing_layer_class(), "columns", counted if name == "in place" else lambda layer, new, free=None: None)
        runs[name] = _greedy_run(model, tiny[1])
    assert used == {"in place": 2 * 300 - 2, "update": 2}  # two layers, each grown once (by update)
    _assert_same_run(runs["in place"], runs["update"])


@needs_lib
@pytest.mark.parametrize("shared", [True, False], ids=["shared prefix", "no prefix"])
def test_the_fused_layer_loop_gives_the_per_layer_loops_bits(tiny, monkeypatch, shared):
    """keel_decode_layers runs a bf16 step's layers in one C call: 300 greedy steps (the buffers
    regrow once, where the step goes through the per-layer loop and `update`) give logits and
    caches bit-equal to the per-layer loop's (KEEL_FUSED_STEP=0), and the fused call ran on every
    other step — with a shared prefix (the prefix's attention kernel) and without one (a
    left-padded cache: the plain kernel)."""
    model = _gqa_model(torch.bfloat16)
    probe = decode.LeanDecoder.build(model)
    if probe.fused is None:
        pytest.skip("no fused step here (keel_linear_pairs does not serve: no AVX512-BF16 kernels, or oneDNN sums in other blocks)")
    calls = {"fused": 0, "returned": 0}
    real_call = decode._FusedLayers.__call__

    def counted(self, *args):
        calls["fused"] += 1
        out = real_call(self, *args)
        calls["returned"] += out is not None
        return out

    monkeypatch.setattr(decode._FusedLayers, "__call__", counted)
    runs = {}
    for name in ("fused", "per layer"):
        monkeypatch.setenv("KEEL_FUSED_STEP", "1" if name == "fused" else "0")
        runs[name] = _greedy_run(model, tiny[1], shared)
    assert calls == {"fused": 300, "returned": 299}  # the step that regrows the buffers falls back
    _assert_same_run(runs["fused"], runs["per layer"])


def test_no_compiler_or_a_failed_build_falls_back_to_torch_ops(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    native.ops.cache_clear()
    try:
        monkeypatch.setenv("KEEL_NATIVE", "0")
        assert native.ops() is None
        native.ops.cache_clear()
        monkeypatch.delenv("KEEL_NATIVE")
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        with caplog.at_level(logging.WARNING, logger="keel.native"):
            assert native.ops() is None
        assert "could not build decode_ops.c" in caplog.text
        assert not any((tmp_path / "native").iterdir())  # no half-written library left behind
    finally:
        native.ops.cache_clear()


@needs_lib
def test_the_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path))
    native.ops.cache_clear()
    try:
        assert native.ops() is not None
        built = list((tmp_path / "native").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        native.ops.cache_clear()
        mtime = built[0].stat().st_mtime_ns
        assert native.ops() is not None and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
    finally:
        native.ops.cache_clear()


@needs_lib
def test_a_compiler_without_openmp_still_builds_the_kernels(tmp_path, monkeypatch):
    """The next flag set is tried when the compiler refuses one: here -fopenmp (single-threaded kernels)."""
    fake = tmp_path / "cc-no-openmp"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "unknown option -fopenmp" >&2; exit 1; }}; done\n'
                    f'exec {native._compiler()} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("KEEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    native.ops.cache_clear()
    try:
        lib = native.ops()
        assert lib is not None
        ops = decode._NativeOps(lib, 1e-5, torch.float32)
        torch.manual_seed(7)
        qkv = torch.randn(2, 8 * 32)
        keys, values = torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 32)
        attn = torch.ones(2, 5, dtype=torch.long)
        got = ops.attend(0, qkv[:, : 4 * 32].view(2, 4, 32), _Layer(None), keys, values, ops.prepare(attn, 0, 4, 2, torch.float32, 32), 0.2)
        expect = _attention_reference(qkv[:, : 4 * 32].view(2, 4, 32), None, None, keys, values, attn.bool(), 0.2)
        torch.testing.assert_close(got.view(2, 4, 32).double(), expect, atol=2e-6, rtol=1e-5)
    finally:
        native.ops.cache_clear()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


@needs_lib
def test_the_bf16_prefix_kernels_follow_the_cpu_the_dtype_and_the_environment(monkeypatch):
    """bf16 models get the fastest bf16 prefix kernel the CPU has (AMX, then AVX512-BF16), fp32
    models the fp32 one; KEEL_AMX=0 and KEEL_DPBF16=0 remove one each; a kernel that cannot run
    here, or that does not exist, is refused by name."""
    flags = _cpu_flags()
    if "avx512_bf16" in flags:  # the library is built with -march=native: the CPU's instructions are in it
        assert "dpbf16" in BF16_KERNELS
    if "amx_bf16" not in flags:
        assert "amx" not in BF16_KERNELS
    assert decode._NativeOps(LIB, 1e-5, torch.float32).kernel == "fp32"
    assert decode._NativeOps(LIB, 1e-5, torch.bfloat16).kernel == (BF16_KERNELS or ["fp32"])[0]
    assert decode._NativeOps(LIB, 1e-5, torch.bfloat16, kernel="fp32").kernel == "fp32"
    with pytest.raises(ValueError, match="'dpbf16' attention kernel cannot run here for torch.float32"):
        decode._NativeOps(LIB, 1e-5, torch.float32, kernel="dpbf16")
    with pytest.raises(ValueError, match="attention kernel 'tiles' is none of fp32, amx, dpbf16"):
        decode._NativeOps(LIB, 1e-5, torch.bfloat16, kernel="tiles")
    monkeypatch.setenv("KEEL_AMX", "0")
    assert native.bf16_kernels(LIB) == [k for k in BF16_KERNELS if k != "amx"]
    monkeypatch.setenv("KEEL_DPBF16", "0")
    assert native.bf16_kernels(LIB) == [] and decode._NativeOps(LIB, 1e-5, torch.bfloat16).kernel == "fp32"
    assert native.bf16_kernels(None) == []
