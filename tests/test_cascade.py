"""Shared-prefix attention (keel.cascade): the split computation equals one SDPA call over the
prefix repeated per row, and a rollout with it samples what a rollout without it samples."""

import pytest
import torch
import torch.nn.functional as F

import keel.rollout as engine
from fakes import EchoEnv, make_tasks
from keel.cascade import split_attention
from keel.rollout import SamplingParams, rollout


def _reference(query, pk, pv, key, value, mask):
    B, H = query.shape[:2]
    rep = H // key.shape[1]
    k = torch.cat([pk.expand(B, -1, -1, -1), key], dim=2).repeat_interleave(rep, dim=1)
    v = torch.cat([pv.expand(B, -1, -1, -1), value], dim=2).repeat_interleave(rep, dim=1)
    full = None
    if mask is not None:
        full = torch.cat([torch.ones(*mask.shape[:-1], pk.shape[2], dtype=torch.bool), mask], dim=-1)
    return F.scaled_dot_product_attention(query.float(), k.float(), v.float(), attn_mask=full)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("q_len", [1, 5])
def test_split_attention_equals_sdpa_over_the_repeated_prefix(dtype, tol, heads, kv, q_len):
    g = torch.Generator().manual_seed(q_len * 10 + heads)
    B, P, L, D = 4, 37, 11, 16
    query = torch.randn(B, heads, q_len, D, generator=g).to(dtype)
    pk, pv = (torch.randn(1, kv, P, D, generator=g).to(dtype) for _ in range(2))
    key, value = (torch.randn(B, kv, L, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(B, 1, q_len, L, generator=g) > 0.4
    mask[0, :, 0, :] = False  # a hole: this query sees only the prefix
    for m in (mask, None):
        out = split_attention(query, pk, pv, key, value, m, None)
        assert out.shape == (B, heads, q_len, D) and out.dtype == dtype
        assert torch.isfinite(out).all()
        assert (out.float() - _reference(query, pk, pv, key, value, m)).abs().max() < tol


def test_rollout_samples_the_same_with_and_without_the_shared_prefix(tiny, monkeypatch):
    model, tok = tiny
    tasks = [t for t in make_tasks(2) for _ in range(3)]
    params = SamplingParams(max_turns=3, max_new_tokens=32)

    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)

    def steer(row, turn):  # rows 0, 2, 4 call a tool in their first turns, so tool blocks enter the cache
        return call if turn < 2 and row % 2 == 0 else None

    def run():
        gens = [torch.Generator().manual_seed(i) for i in range(len(tasks))]
        return rollout(model, tok, EchoEnv(), tasks, params, generator=gens, steer=steer)

    calls = []
    original = engine._cascade_attention

    def spy(m, enabled):
        calls.append(enabled)
        return original(m, enabled)

    monkeypatch.setattr(engine, "_cascade_attention", spy)
    shared = run()
    assert calls == [True]
    monkeypatch.setattr(engine, "_cascade_attention", lambda m, enabled: original(m, False))
    repeated = run()
    assert model.config._attn_implementation == "sdpa"  # restored after the rollout
    assert sum(len(t.turn_spans) for t in shared) > len(tasks)  # some rows continued past a tool block
    for a, b in zip(shared, repeated):
        assert a.token_ids == b.token_ids and a.sources == b.sources
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_prefill_encodes_long_prompts_that_share_little_one_by_one(tiny, monkeypatch):
    """The padded block (shared prefix once, remainders right-aligned under a mask) is chosen
    when prompts share most of their tokens (the KG env's system block; a group of one task);
    long prompts sharing a short start (BFCL's tasks) go one by one, and their last logits are
    each prompt's own forward."""
    model, _ = tiny
    g = torch.Generator().manual_seed(0)
    start = torch.randint(5, 1000, (6,), generator=g).tolist()
    tails = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (40, 55, 31)]
    seen = []
    original = engine._prefill_each
    monkeypatch.setattr(engine, "_prefill_each", lambda m, p, d: seen.append(len(p)) or original(m, p, d))
    with torch.no_grad():
        long_tails = [start + t for t in tails]  # lcp 6, remainders up to 55
        logits, _, attn = engine._prefill(model, long_tails, "cpu")
        assert seen == [3] and attn.shape == (3, 61) and attn.sum(1).tolist() == [46, 61, 37]
        for row, p in enumerate(long_tails):
            alone = model(input_ids=torch.tensor([p])).logits[0, -1]
            assert (logits[row] - alone).abs().max() < 1e-4
        engine._prefill(model, [tails[0] + t[:3] for t in tails], "cpu")  # lcp 40, remainders 3: one block
        engine._prefill(model, [long_tails[1]] * 4, "cpu")  # a group of one task: one block
    assert seen == [3]


@pytest.mark.parametrize("cascading", [False, True])
def test_prefill_encodes_each_distinct_question_once(tiny, monkeypatch, cascading):
    """A GRPO batch asks each question group_size times: the block forward gets each distinct
    remainder once, and every row's last logits, keys, values and mask equal those of the same
    prompt in a batch without repeats (fp32: bit for bit), and its own forward's logits."""
    model, _ = tiny
    g = torch.Generator().manual_seed(1)
    start = torch.randint(5, 1000, (40,), generator=g).tolist()
    a, b, c = (start + torch.randint(5, 1000, (n,), generator=g).tolist() for n in (5, 9, 2))
    rows = [a, b, a, a, c, b]
    fed = []
    original = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda m, ids, *rest: fed.append(ids.shape[0]) or original(m, ids, *rest))
    with torch.no_grad(), engine._cascade_attention(model, cascading):
        logits, cache, attn = engine._prefill(model, rows, "cpu")
        assert fed == [3]
        once, once_cache, once_attn = engine._prefill(model, [a, b, c], "cpu")
        which = [0, 1, 0, 0, 2, 1]
        assert torch.equal(logits, once[which]) and torch.equal(attn, once_attn[which])
        for layer, single in zip(cache.layers, once_cache.layers):
            assert torch.equal(layer.keys, single.keys[which]) and torch.equal(layer.values, single.values[which])
            assert (layer.prefix is not None) == cascading
        for row, p in enumerate(rows):
            alone = model(input_ids=torch.tensor([p])).logits[0, -1]
            assert (logits[row] - alone).abs().max() < 1e-4
