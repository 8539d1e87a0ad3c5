"""keel.decode.LeanDecoder computes transformers' decode step: same logits on the same cache,
so a rollout with it samples the same ids with the same log-probs (fp32)."""

import copy

import pytest
import torch

import keel.decode as decode
import keel.rollout as engine
from fakes import EchoEnv, make_tasks
from keel.decode import LeanDecoder
from keel.rollout import SamplingParams, rollout


def _episodes(tiny, lean: bool, temperature: float = 1.0):
    model, tok = tiny
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)

    def steer(row, turn):  # rows make row % 3 calls, then sample freely: ragged multi-turn batches
        return call if turn < row % 3 else None

    params = SamplingParams(max_turns=4, max_new_tokens=24, temperature=temperature)
    return rollout(model, tok, EchoEnv(lengths=(1, 7, 3, 12)), make_tasks(6), params,
                   generator=torch.Generator().manual_seed(3), steer=steer, lean=lean)


def _same(a, b):
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    diff = max(abs(x - y) for ta, tb in zip(a, b) for x, y in zip(ta.logprobs, tb.logprobs))
    assert diff <= 1e-5, diff
    assert sum(t.num_policy_tokens for t in a) > 60


def test_lean_decode_equals_transformers_forward_with_shared_prefix(tiny):
    assert engine.cascade.available()  # on CPU the prompts' shared prefix sits once per layer
    _same(_episodes(tiny, lean=True), _episodes(tiny, lean=False))


def test_lean_decode_equals_transformers_forward_with_repeated_prefix(tiny, monkeypatch):
    shipped = engine._cascade_attention
    monkeypatch.setattr(engine, "_cascade_attention", lambda model, enabled: shipped(model, False))
    _same(_episodes(tiny, lean=True, temperature=0.7), _episodes(tiny, lean=False, temperature=0.7))


def test_step_logits_match_a_full_forward(tiny):
    """One decode step from a plain cache vs the model's logits at the last position of a full forward."""
    model, tok = tiny
    ids = torch.tensor([tok.encode("The quick brown fox jumps over", add_special_tokens=False)])
    with torch.no_grad():
        full = model(input_ids=ids).logits[0, -1].float()
        cache = engine._growing_cache()
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        n = ids.shape[1]
        logits = LeanDecoder.build(model).step(ids[:, -1:], torch.ones(1, n, dtype=torch.long), torch.tensor([[n - 1]]), cache)
    assert (logits[0] - full).abs().max().item() <= 1e-4


def test_block_matches_transformers_forward_on_the_same_cache(tiny):
    """W tokens per row at once (a tool-response block) with hidden columns in the mask: the last
    column's logits and the keys and values appended at visible columns equal transformers'
    forward of the same block (the block's hidden columns are not computed)."""
    model, tok = tiny
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)] * 2)
    ids[1, -3] = ids[0, 2]  # the rows' blocks differ
    n, W = ids.shape[1], 4
    attn = torch.ones(2, n, dtype=torch.long)
    attn[1, 1:3] = 0  # row 1 hides two cached columns
    attn[0, n - W] = 0  # and row 0 its block's first token (left padding of a ragged block)
    positions = torch.arange(n - W, n).repeat(2, 1)
    caches = []
    with torch.no_grad():
        for _ in range(2):
            caches.append(engine._growing_cache())
            model(input_ids=ids[:, :-W], past_key_values=caches[-1], use_cache=True)
        want = model(input_ids=ids[:, -W:], attention_mask=attn, position_ids=positions, past_key_values=caches[0],
                     use_cache=True).logits[:, -1].float()
        got = LeanDecoder.build(model).block(ids[:, -W:], attn, positions, caches[1])
    assert (got - want).abs().max().item() <= 1e-4
    visible = attn.bool()  # [2, n]; a hidden column is never read (every later mask hides it too)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.keys.shape == b.keys.shape == (2, a.keys.shape[1], n, a.keys.shape[3])
        for want_kv, got_kv in ((a.keys, b.keys), (a.values, b.values)):
            assert (want_kv - got_kv).abs().amax(dim=(1, 3))[visible].max().item() <= 1e-5


def test_other_layouts_keep_transformers_forward():
    assert LeanDecoder.build(torch.nn.Linear(2, 2)) is None


def test_fp32_weights_are_laid_out_for_batches_of_four_rows_or_more(tiny):
    """fp32: for a batch of `FP32_PACKED_MIN_ROWS` rows or more the product is oneDNN's on the
    laid-out weight, below that MKL's on the plain weight (bit for bit `x @ w.T`); the two agree
    within fp32 summation-order error, and the decoder lays its weights out by the batch it is
    built for."""
    if not decode._onednn_linear():
        pytest.skip("this torch has no oneDNN linear ops")
    w = torch.randn(192, 576, generator=torch.Generator().manual_seed(0))  # SmolLM2's width: on the AMX Xeon the two kernels' sums differ at every row count here
    small, large = decode.laid_out(w, rows=decode.FP32_PACKED_MIN_ROWS - 1), decode.laid_out(w, rows=decode.FP32_PACKED_MIN_ROWS)
    assert isinstance(large, decode._Packed) and not isinstance(small, decode._Packed)
    for rows in (1, 3, 4, 16):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        plain = x @ w.T
        assert torch.equal(small(x), plain), rows
        assert torch.equal(large(x), torch.ops.mkldnn._linear_pointwise(x, large.packed, None, "none", [], "")), rows
        assert (large(x) - plain).abs().max().item() <= 1e-5 * plain.abs().max().item()
    model, _ = tiny
    assert isinstance(LeanDecoder.build(model, rows=6).lm_head, decode._Packed)
    assert not isinstance(LeanDecoder.build(model, rows=2).lm_head, decode._Packed)


def test_packed_bf16_weights_give_the_same_episodes_bit_for_bit(tiny, monkeypatch):
    """bf16 sampler: the decode step's weights laid out once for oneDNN (`_Packed`) vs multiplied
    as plain tensors — the same token ids and the same log-probs, to the last bit."""
    model, tok = tiny
    probe = model.lm_head.weight.detach().to(torch.bfloat16)
    if not decode._packs(probe):
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    bf16 = (copy.deepcopy(model).to(torch.bfloat16).eval(), tok)
    monkeypatch.setattr(decode, "_pairs", lambda weight: None)  # oneDNN's kernels, not keel_linear_pairs (below)
    assert isinstance(LeanDecoder(bf16[0]).lm_head, decode._Packed)
    packed = _episodes(bf16, lean=True, temperature=0.7)
    monkeypatch.setattr(decode, "_packs", lambda weight, rows: False)
    plain = _episodes(bf16, lean=True, temperature=0.7)
    assert [t.token_ids for t in packed] == [t.token_ids for t in plain]
    assert [t.logprobs for t in packed] == [t.logprobs for t in plain]
    assert sum(t.num_policy_tokens for t in packed) > 60


def _pairs_or_skip(weight: torch.Tensor):
    pairs = decode._pairs(weight)
    if pairs is None:
        pytest.skip("keel_linear_pairs does not serve here (no AVX512-BF16 kernels, or oneDNN sums in other blocks)")
    return pairs


def _pair_sums(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """keel_linear_pairs' arithmetic in torch ops, one fp32 rounding per step: per input pair
    (2i, 2i+1), the odd product added then the even one (VDPBF16PS), each block of `block` inputs
    summed from zero, the blocks' sums added in order, rounded once to bf16."""
    x, w = x.float(), w.float()
    total = None
    for start in range(0, x.shape[1], block):
        acc = torch.zeros(x.shape[0], w.shape[0])
        for j in range(start, min(start + block, x.shape[1]), 2):
            acc = acc + x[:, j + 1, None] * w[None, :, j + 1]
            acc = acc + x[:, j, None] * w[None, :, j]
        total = acc if total is None else total + acc
    return total.to(torch.bfloat16)


def test_pairs_kernel_sums_pairs_in_blocks_as_documented():
    """keel_linear_pairs against its arithmetic written out in torch ops (`_pair_sums`), for row
    counts across its 8-row tiles and blocks that split the inputs unevenly, whatever oneDNN does
    on this CPU."""
    lib = decode.native.ops()
    if "dpbf16" not in decode.native.bf16_kernels(lib):
        pytest.skip("no AVX512-BF16 kernels here")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 40, generator=g).to(torch.bfloat16)
    pairs = decode._Pairs(lib, w)
    for rows in (1, 5, 8, 11):
        x = (torch.randn(rows, 40, generator=g) * 3).to(torch.bfloat16)
        for block in (16, 40, 64):
            pairs.blocks = (block, block)
            assert torch.equal(pairs(x), _pair_sums(x, w, block)), (rows, block)


def test_boundary_probe_shows_each_block_start():
    """`_boundary_probe`, times a row of 2^12: 2 where a block starts at input 2i+2 (columns c with
    2(c mod 6) + 2 a multiple of the block), 0 elsewhere — the values worked out in its docstring."""
    w = decode._boundary_probe(32, 16, 0)  # 16 inputs: i cycles 0..5
    x = torch.full((1, 16), 2.0**12).to(torch.bfloat16)
    for block in (4, 8):
        want = torch.tensor([[2.0 if (2 * (c % 6) + 2) % block == 0 else 0.0 for c in range(32)]])
        assert torch.equal(_pair_sums(x, w, block).float(), want), block


def test_pairs_give_onednn_products_bit_for_bit():
    """Where `_pairs` serves a weight, its products are `_Packed`'s to the last bit at every row
    count (one row and more sum in different blocks for 1,536 inputs on a Zen 4 EPYC)."""
    g = torch.Generator().manual_seed(1)
    for inp in (576, 1536):  # SmolLM2-135M's layers' inputs
        w = (torch.randn(96, inp, generator=g) * 0.05).to(torch.bfloat16)
        pairs, onednn = _pairs_or_skip(w), decode._Packed(w)
        assert all(b in decode.PAIR_BLOCKS for b in pairs.blocks)
        for rows in (1, 2, 3, 8, 9, 16, 37, 100):
            x = torch.randn(rows, inp, generator=g).to(torch.bfloat16)
            assert torch.equal(pairs(x), onednn(x)), (inp, rows)


def test_a_weight_no_block_agrees_for_stays_with_onednn(monkeypatch):
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    _pairs_or_skip(w)
    monkeypatch.setattr(decode, "_blocks", {})
    monkeypatch.setattr(decode, "PAIR_BLOCKS", (6,))  # no oneDNN sums in blocks of 6 inputs
    assert decode._pairs(w) is None and isinstance(decode.laid_out(w), decode._Packed)
    assert decode._blocks == {(64, 576, torch.get_num_threads()): None}


def test_pair_weights_give_the_same_episodes_bit_for_bit(tiny, monkeypatch):
    """bf16 sampler on keel_linear_pairs vs on oneDNN's kernels: the same token ids and log-probs."""
    model, tok = tiny
    bf16 = (copy.deepcopy(model).to(torch.bfloat16).eval(), tok)
    _pairs_or_skip(model.lm_head.weight.detach().to(torch.bfloat16))
    assert isinstance(LeanDecoder(bf16[0]).lm_head, decode._Pairs)
    ours = _episodes(bf16, lean=True, temperature=0.7)
    monkeypatch.setattr(decode, "_pairs", lambda weight: None)
    assert isinstance(LeanDecoder(bf16[0]).lm_head, decode._Packed)
    onednn = _episodes(bf16, lean=True, temperature=0.7)
    assert [t.token_ids for t in ours] == [t.token_ids for t in onednn]
    assert [t.logprobs for t in ours] == [t.logprobs for t in onednn]
    assert sum(t.num_policy_tokens for t in ours) > 60
