"""The shared-prefix forward used in training equals one plain forward: values and gradients."""

import contextlib
import copy

import pytest
import torch

from keel.logprobs import MIN_SHARED_PREFIX, _hidden_states, micro_batches, shared_prefix_len, token_logprobs


def _batch(tok):
    prefix = tok.encode("<|im_start|>system\n" + "You answer questions with tools. " * 12, add_special_tokens=False)
    rows = [prefix + tok.encode(f"question {i} " * (i + 1), add_special_tokens=False) for i in range(4)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(4, T, dtype=torch.long)
    attn = torch.zeros(4, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    target = attn.bool().clone()
    target[:, : len(prefix) - 3] = False  # targets start a little inside the shared prefix
    target[:, 0] = False
    return ids, attn, target, len(prefix)


def test_shared_prefix_length():
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 5, 6], [1, 2, 9, 9, 9]])
    attn = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert shared_prefix_len(ids, attn) == 2
    assert shared_prefix_len(ids[:2], attn[:2]) == 3
    assert shared_prefix_len(ids[:1], attn[:1]) == 0  # one row: nothing to share


def test_shared_prefix_forward_equals_plain_forward(tiny):
    model, tok = tiny
    ids, attn, target, plen = _batch(tok)
    assert shared_prefix_len(ids, attn) >= plen - 1 >= 32
    body = getattr(model, model.base_model_prefix)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    m_plain, m_shared = copy.deepcopy(model), copy.deepcopy(model)
    plain_body = getattr(m_plain, m_plain.base_model_prefix)
    # plain: one forward of every full row
    h = plain_body(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False).last_hidden_state
    with torch.no_grad():
        hs = _hidden_states(body, ids, attn)
    valid = attn.bool()
    assert torch.allclose(h[valid], hs[valid], atol=1e-5)
    # gradients of the log-prob loss agree too
    lp_plain = torch.log_softmax(m_plain.get_output_embeddings()(h).float(), -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0][target[:, 1:]]
    lp_plain.sum().backward()
    lp_shared, _ = token_logprobs(m_shared, ids, attn, target)
    assert torch.allclose(lp_plain, lp_shared, atol=1e-5)
    lp_shared.sum().backward()
    for (n, a), (_, b) in zip(m_plain.named_parameters(), m_shared.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), n


def _grads(model, ids, attn, tmask, chunk):
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, ids, attn, tmask, temperature=0.7, chunk=chunk, with_entropy=True)
    (logp * torch.linspace(-1.0, 1.0, logp.numel())).sum().backward()
    return logp.detach(), ent, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_recomputed_head_and_gradient_checkpointing_give_the_plain_gradient(tiny):
    """Each LM-head chunk's log-softmax is recomputed in backward from its kept logits
    (token_logprobs) and decoder layers can be too (model.gradient_checkpointing); values,
    entropies and gradients equal a plain autograd pass through the full logits."""
    model, _ = tiny
    model = copy.deepcopy(model).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 1000, (3, 40), generator=g)
    ids[2, :30] = ids[0, :30]  # rows 0 and 2 share a 30-token prefix...
    attn = torch.ones_like(ids)
    attn[1, :7] = 0  # ...and row 1 is left-padded, so this batch takes the plain path; see below
    tmask = torch.zeros_like(ids, dtype=torch.bool)
    tmask[0, 10:] = True
    tmask[1, 20:35] = True
    tmask[2, 31:] = True

    # reference: full logits, no recompute anywhere
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / 0.7
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    prev = tmask[:, 1:]
    want = logp_all[prev].gather(1, ids[:, 1:][prev][:, None])[:, 0]
    want_ent = -(logp_all[prev].exp() * logp_all[prev]).sum(-1)
    (want * torch.linspace(-1.0, 1.0, want.numel())).sum().backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    for checkpointing in (False, True):
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        logp, ent, grads = _grads(model, ids, attn, tmask, chunk=16)  # 54 targets: 4 chunks
        assert torch.allclose(logp, want.detach(), atol=1e-5)
        assert torch.allclose(ent, want_ent.detach(), atol=1e-4)
        assert grads.keys() == want_grads.keys()
        for k in grads:
            assert torch.allclose(grads[k], want_grads[k], atol=1e-6, rtol=1e-4), (checkpointing, k)


def test_gradient_checkpointing_with_a_shared_prefix_batch(tiny):
    """A batch whose rows share a long prompt prefix (the shared-prefix forward) under gradient
    checkpointing falls back to one plain forward: same values and gradients."""
    model, _ = tiny
    model = copy.deepcopy(model).train()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 1000, (3, 48), generator=g)
    ids[1:, :MIN_SHARED_PREFIX + 4] = ids[0, :MIN_SHARED_PREFIX + 4]
    attn = torch.ones_like(ids)
    tmask = torch.zeros_like(ids, dtype=torch.bool)
    tmask[:, MIN_SHARED_PREFIX + 6 :] = True
    plain = _grads(model, ids, attn, tmask, chunk=1024)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ckpt = _grads(model, ids, attn, tmask, chunk=1024)
    assert torch.allclose(plain[0], ckpt[0], atol=1e-5)
    for k in plain[2]:
        assert torch.allclose(plain[2][k], ckpt[2][k], atol=1e-6, rtol=1e-4), k


def test_micro_batches_cut_by_rows_and_encoded_positions():
    # no shared prefix: cost = rows × longest
    plain = [list(range(1000, 1100)), list(range(2000, 2100)), list(range(3000, 3300))]
    assert micro_batches(plain, max_rows=8, max_tokens=300) == [[0, 1], [2]]  # 2×100 = 200; 3×300 = 900
    # without a cap, still the fewest positions: 200 + 300, not 3×300 in one; [[0], [1], [2]] is
    # also 500 but one micro-batch more
    assert micro_batches(plain, max_rows=8, max_tokens=0) == [[0, 1], [2]]
    assert micro_batches(plain[:2], max_rows=8, max_tokens=0) == [[0, 1]]
    assert micro_batches(plain, max_rows=1, max_tokens=0) == [[0], [1], [2]]
    # a row over the cap still trains, alone
    assert micro_batches([[1] * 10, [2] * 500, [3] * 10], max_rows=8, max_tokens=100) == [[0], [1], [2]]
    # a 40-token shared prefix (≥ MIN_SHARED_PREFIX) is encoded once: cost = 40 + rows × (longest − 40)
    assert MIN_SHARED_PREFIX <= 40
    p = list(range(500, 540))
    shared = [p + [1] * 60, p + [2] * 60, p + [3] * 60]  # lengths 100
    assert micro_batches(shared, max_rows=8, max_tokens=220) == [[0, 1, 2]]  # 40 + 3×60 = 220
    assert micro_batches(shared, max_rows=8, max_tokens=219) == [[0, 1], [2]]  # 40 + 2×60 = 160, then 100
    # lengths 50, 60, 100: 40 + 2×20 = 80, then 100 alone, is fewer positions than 40 + 3×60 = 220
    uneven = [p + [1] * 10, p + [2] * 20, p + [3] * 60]
    assert micro_batches(uneven, max_rows=8, max_tokens=220) == [[0, 1], [2]]
    # a 10-token common prefix is below MIN_SHARED_PREFIX: not shared, cost = rows × longest
    short = [list(range(10)) + [1] * 40, list(range(10)) + [2] * 40]
    assert micro_batches(short, max_rows=8, max_tokens=99) == [[0], [1]]
    assert micro_batches(short, max_rows=8, max_tokens=100) == [[0, 1]]
    assert micro_batches([], max_rows=8, max_tokens=100) == []


def test_micro_batches_cut_where_rows_stop_sharing():
    """GRPO's rows: a 40-token system block every row shares, then two groups of 3 samples whose
    question (40 tokens) their group shares. A greedy fill under a 400-position cap takes 4 rows
    (40 + 4 × 90 = 400) and leaves 2 (40 + 2 × 90 = 220): 620 positions; cut at the groups,
    each micro-batch is 80 + 3 × 50 = 230: 460 positions."""
    system = list(range(100, 140))
    q1, q2 = list(range(200, 240)), list(range(300, 340))
    rows = [system + q + [k + 10 * i] * 50 for q, k in ((q1, 1000), (q2, 2000)) for i in range(3)]
    assert micro_batches(rows, max_rows=8, max_tokens=400) == [[0, 1, 2], [3, 4, 5]]
    # two rows at most: [0, 1] 80 + 2×50 = 180, [2, 3] across the groups 40 + 2×90 = 220, [4, 5]
    # 180: 580 in all, fewer than [0, 1], [2], [3, 4], [5]: 180 + 130 + 180 + 130 = 620
    assert micro_batches(rows, max_rows=2, max_tokens=400) == [[0, 1], [2, 3], [4, 5]]
    # rows sorted by length: the long ones together, not padding the short ones
    lens = [10, 10, 10, 10, 200, 200]
    plain = [[k * 1000 + t for t in range(n)] for k, n in enumerate(lens)]
    assert micro_batches(plain, max_rows=8, max_tokens=0) == [[0, 1, 2, 3], [4, 5]]  # 40 + 400, not 6 × 200


def test_micro_batch_cost_is_what_the_forward_encodes():
    """The prefix micro_batches assumes shared is the one _hidden_states shares (random batches)."""
    from keel.logprobs import collate
    from keel.types import Source, Trajectory

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(2, 5, (1,), generator=g))
        base = torch.randint(5, 50, (int(torch.randint(0, 80, (1,), generator=g)),), generator=g).tolist()
        seqs = []
        for _ in range(n):
            cut = int(torch.randint(0, len(base) + 1, (1,), generator=g))
            seqs.append(base[:cut] + torch.randint(5, 50, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist())

        def encoded(rows: list[int]) -> int:
            b = collate([Trajectory(task_id="t", token_ids=seqs[i], sources=[int(Source.POLICY)] * len(seqs[i]),
                                    logprobs=[0.0] * len(seqs[i])) for i in rows])
            lcp = shared_prefix_len(b.input_ids, b.attention_mask)
            shared = lcp if lcp >= MIN_SHARED_PREFIX else 0
            return shared + len(rows) * (b.input_ids.shape[1] - shared)

        cost = encoded(list(range(n)))
        parts = micro_batches(seqs, max_rows=n, max_tokens=cost)  # one micro-batch fits; a cut may encode fewer
        assert sum(encoded(p) for p in parts) <= cost and all(encoded(p) <= cost for p in parts)
        if parts != [list(range(n))]:
            assert sum(encoded(p) for p in parts) < cost
        assert len(micro_batches(seqs, max_rows=n, max_tokens=cost - 1)) > 1


def _right_padded(rows: list[list[int]], first_target: int, also: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, target_mask) of right-padded rows; targets: every real position
    from `first_target` on, and position `also`."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        attn[b, : len(row)] = 1
    tmask = attn.bool().clone()
    tmask[:, :first_target] = False
    tmask[:, also] = True
    return ids, attn, tmask


def test_update_wide_prefix_gives_the_per_micro_batch_gradients(tiny):
    """SharedPrefix: the prefix encoded once for two micro-batches gives the values and weight
    gradients of each micro-batch encoding it itself."""
    from keel.logprobs import SharedPrefix, common_prefix_len

    model, _ = tiny
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 200, (40,), generator=g).tolist()
    seqs = [prefix + torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 12, 3, 9)]
    assert common_prefix_len(seqs) == 40 and common_prefix_len(seqs[:1]) == 0
    parts = [[0, 1], [2, 3]]

    def run(shared: bool):
        m = copy.deepcopy(model).train()
        pre = SharedPrefix(m, prefix) if shared else None
        values = []
        for part in parts:
            # a target inside the prefix too: the prefix's hidden states get gradients
            ids, attn, tmask = _right_padded([seqs[i] for i in part], first_target=41, also=30)
            lp, _ = token_logprobs(m, ids, attn, tmask, prefix=pre)
            (lp * torch.linspace(-1, 2, lp.numel())).sum().backward()
            values.append(lp.detach())
        if pre is not None:
            pre.backward()
        return torch.cat(values), {n: p.grad for n, p in m.named_parameters()}

    v0, g0 = run(False)
    v1, g1 = run(True)
    assert torch.allclose(v0, v1, atol=1e-5)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4), n


def test_a_groups_question_is_encoded_once_on_top_of_the_update_prefix(tiny):
    """GRPO's micro-batches: rows sharing the update's system block (SharedPrefix) and, per
    group, a question. The question is encoded once per micro-batch on top of the prefix: the
    same values and weight gradients as each row encoded alone (targets inside the question
    too), and the positions the network encodes are micro_batches' cost less the prefix."""
    from keel.logprobs import SharedPrefix

    model, _ = tiny
    g = torch.Generator().manual_seed(7)
    system = torch.randint(5, 200, (40,), generator=g).tolist()
    questions = [torch.randint(5, 200, (36,), generator=g).tolist() for _ in range(2)]
    suffix = [7, 12, 3, 9, 5]
    seqs = [system + questions[0 if r < 3 else 1] + [5 + r] + torch.randint(5, 200, (n - 1,), generator=g).tolist()
            for r, n in enumerate(suffix)]
    parts = [[0, 1, 2], [3, 4]]
    assert micro_batches(seqs, max_rows=8, max_tokens=120) == parts  # 76 + 3×12 = 112, 76 + 2×9 = 94

    def batch(rows):  # a target inside the question too: its hidden state is shared by the rows
        return _right_padded([seqs[i] for i in rows], first_target=77, also=60)

    def run(shared: bool):
        m = copy.deepcopy(model).train()
        seen = []
        hook = m.get_input_embeddings().register_forward_hook(lambda mod, args, out: seen.append(args[0].numel()))
        pre = SharedPrefix(m, system) if shared else None
        values = []
        for part in parts if shared else [[i] for p in parts for i in p]:
            ids, attn, tmask = batch(part)
            lp, _ = token_logprobs(m, ids, attn, tmask, prefix=pre)
            (lp * torch.cos(ids[tmask].float())).sum().backward()  # a weight per token, whatever the batching
            values.append(lp.detach())
        if pre is not None:
            pre.backward()
        hook.remove()
        return torch.cat(values), {n: p.grad for n, p in m.named_parameters()}, sum(seen)

    v0, g0, n0 = run(False)
    v1, g1, n1 = run(True)
    assert n0 == sum(len(q) for q in seqs)
    # the prefix, each micro-batch's question and its rows' remainders packed (no padding), the prefix again in backward
    assert n1 == 40 + (36 + 7 + 12 + 3) + (36 + 9 + 5) + 40
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KEEL_PACK_ROWS", "0")  # the remainders right-padded to the longest: micro_batches' count
        v2, g2, n2 = run(True)
    assert n2 == 40 + (36 + 3 * 12) + (36 + 2 * 9) + 40
    for v, g in ((v1, g1), (v2, g2)):
        assert torch.allclose(v0, v, atol=1e-5)
        for n in g0:
            assert torch.allclose(g0[n], g[n], atol=1e-5, rtol=1e-4), n


def test_a_reference_prefix_is_encoded_once_while_its_weights_are_the_same(tiny):
    """update_prefix(reuse=True) (the KL reference): the second update with the same prefix gets
    the first one's encoding back, and the log-probs through it equal those of a fresh encoding
    and of no shared prefix at all; other prefix tokens, autocast, or weights changed in place
    encode it again; with gradients on it is refused."""
    import pytest

    from keel.logprobs import update_prefix
    from keel.models import frozen_copy

    model, _ = tiny
    ref = frozen_copy(model)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(5, 200, (40,), generator=g).tolist()
    seqs = [prefix + torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 12)]
    parts = [[0], [1]]
    ids = torch.tensor([seqs[1]])
    attn = torch.ones_like(ids)
    tmask = attn.bool().clone()
    tmask[:, :41] = False
    with torch.no_grad():
        first = update_prefix(ref, seqs, parts, reuse=True)
        again = update_prefix(ref, [list(s) for s in seqs], parts, reuse=True)
        assert first is not None and again is first
        fresh = update_prefix(ref, seqs, parts)
        assert fresh is not first
        lp_kept, _ = token_logprobs(ref, ids, attn, tmask, prefix=again)
        lp_fresh, _ = token_logprobs(ref, ids, attn, tmask, prefix=fresh)
        lp_plain, _ = token_logprobs(ref, ids, attn, tmask)
        assert torch.equal(lp_kept, lp_fresh)
        assert torch.allclose(lp_kept, lp_plain, atol=1e-5)
        other = [[7] + s[1:] for s in seqs]
        o32 = update_prefix(ref, other, parts, reuse=True)
        assert o32 is not first  # other tokens: encoded again
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = update_prefix(ref, other, parts, reuse=True)
            assert bf16 is not o32 and update_prefix(ref, other, parts, reuse=True) is bf16
        again = update_prefix(ref, other, parts, reuse=True)
        assert again is not bf16  # autocast off again: encoded again
        next(ref.parameters()).mul_(1.0)  # the same values, written in place: the weights may have changed
        assert update_prefix(ref, other, parts, reuse=True) is not again
    with pytest.raises(ValueError, match="reuse=True"):
        update_prefix(ref, seqs, parts, reuse=True)  # gradients enabled


def _saved_bytes(fn) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs, and their shapes."""
    seen: dict[int, int] = {}
    shapes = []

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()), shapes


def test_training_attention_keeps_no_repeated_keys_and_changes_no_value(tiny):
    """keel.logprobs._training_sdpa: grouped-query keys and values go to SDPA as they are, and the
    mask is made additive once per forward. transformers' SDPA path (the body run directly)
    repeats keys and values to every query head and backward keeps those copies; the values and
    gradients are the same."""
    from keel.logprobs import _hidden_states_of

    model, tok = tiny
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    assert kv < heads  # the tiny model has grouped-query attention, as SmolLM2 does
    ids, attn, target, _ = _batch(tok)
    B, T = ids.shape
    m_hf, m_keel = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    body_hf, body_keel = m_hf.model, m_keel.model

    valid = attn.bool()  # padding's hidden states are never used (packed rows leave them zero)
    hf_bytes, hf_shapes = _saved_bytes(lambda: _hidden_states_of(body_hf, ids, attn, None)[valid].square().sum().backward())
    keel_bytes, keel_shapes = _saved_bytes(lambda: _hidden_states(body_keel, ids, attn)[valid].square().sum().backward())
    head_dim = cfg.hidden_size // heads
    repeated = [s for s in hf_shapes if len(s) == 4 and s[1] == heads and s[3] == head_dim]
    assert len(repeated) > len([s for s in keel_shapes if len(s) == 4 and s[1] == heads and s[3] == head_dim])
    # at least the repeated keys and values of every layer (fp32: 4 bytes) are no longer kept
    assert hf_bytes - keel_bytes >= 2 * cfg.num_hidden_layers * B * (heads - kv) * head_dim * 4 * (T - shared_prefix_len(ids, attn)) // 2
    for (n, a), (_, b) in zip(m_hf.named_parameters(), m_keel.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), n
    with torch.no_grad():
        assert torch.allclose(_hidden_states_of(body_hf, ids, attn, None)[valid], _hidden_states(body_keel, ids, attn)[valid], atol=1e-5)
    assert m_keel.config._attn_implementation == "sdpa"  # switched back after the forward


def test_update_wide_prefix_keeps_no_graph_until_its_backward(tiny):
    """SharedPrefix encodes the prefix without a graph and encodes it again in `backward`: nothing
    is kept for backward between (the KG task's ~580-token system block cost ~650 MB held over a
    whole update), and the gradients it sends are the ones test_update_wide_prefix_... checks."""
    from keel.logprobs import SharedPrefix

    model, _ = tiny
    m = copy.deepcopy(model).train()
    prefix = torch.randint(5, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    holder = []
    kept, _ = _saved_bytes(lambda: holder.append(SharedPrefix(m, prefix)))
    assert kept == 0
    pre = holder[0]
    hidden, cache = pre.states(2)
    assert hidden.requires_grad and hidden.grad_fn is not None and all(leaf.grad_fn is None for leaf in pre._leaves)
    with torch.no_grad():
        frozen = SharedPrefix(m, prefix)
    assert not any(leaf.requires_grad for leaf in frozen._leaves)  # the reference's prefix takes no gradient


def _prefix_rows(seed: int):
    """A 40-token prefix and two right-padded rows that start with it (6 and 11 tokens more):
    (prefix, input_ids [2, 51], attention_mask, target_mask) with targets after the prefix and
    one inside it, at position 20, whose hidden state then gets gradients too."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, 200, (40,), generator=g).tolist()
    seqs = [prefix + torch.randint(5, 200, (n,), generator=g).tolist() for n in (6, 11)]
    ids = torch.zeros(2, 51, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, q in enumerate(seqs):
        ids[b, : len(q)] = torch.tensor(q)
        attn[b, : len(q)] = 1
    tmask = attn.bool().clone()
    tmask[:, :41] = False
    tmask[:, 20] = True
    return prefix, ids, attn, tmask


def test_the_prefix_encoded_again_in_segments_gives_the_same_gradients(tiny):
    """SharedPrefix.backward encodes the prefix `segment` positions at a time, last segment first,
    each attending to the stored keys and values before it as leaves: the weight gradients equal
    those of one segment (and so, by test_update_wide_prefix_..., of every micro-batch encoding
    the prefix itself), with targets inside the prefix too."""
    from keel.logprobs import SharedPrefix

    model, _ = tiny
    prefix, ids, attn, tmask = _prefix_rows(seed=5)

    def grads(segment: int):
        m = copy.deepcopy(model).train()
        pre = SharedPrefix(m, prefix, segment=segment)
        lp, _ = token_logprobs(m, ids, attn, tmask, prefix=pre)
        (lp * torch.linspace(-1, 2, lp.numel())).sum().backward()
        pre.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    whole = grads(40)
    for segment in (16, 7):
        got = grads(segment)
        for n in whole:
            assert torch.allclose(whole[n], got[n], atol=1e-5, rtol=1e-4), (segment, n)


def test_a_kept_prefix_graph_gives_the_gradients_of_the_prefix_encoded_again(tiny):
    """SharedPrefix(keep_graph=True) holds the first encoding's graph and back-propagates it in
    `backward()` instead of encoding the prefix again in segments: the same log-probs, and weight
    gradients within float32 rounding of the segmented ones (targets inside the prefix too); what
    it keeps for backward is the prefix's graph, which the default keeps none of."""
    from keel.logprobs import SharedPrefix

    model, _ = tiny
    prefix, ids, attn, tmask = _prefix_rows(seed=7)

    def run(keep: bool):
        m = copy.deepcopy(model).train()
        holder = []
        saved, _ = _saved_bytes(lambda: holder.append(SharedPrefix(m, prefix, segment=16, keep_graph=keep)))
        pre = holder[0]
        lp, _ = token_logprobs(m, ids, attn, tmask, prefix=pre)
        (lp * torch.linspace(-1, 2, lp.numel())).sum().backward()
        pre.backward()
        assert pre._sources == [] and pre._leaves == []  # the graph is let go
        return saved, lp.detach(), {n: p.grad for n, p in m.named_parameters()}

    saved_again, lp_again, again = run(False)
    saved_kept, lp_kept, kept = run(True)
    assert saved_again == 0 and saved_kept > 0
    assert torch.equal(lp_again, lp_kept)  # the same forward values: only the backward's route differs
    for n in again:
        assert torch.allclose(again[n], kept[n], atol=1e-5, rtol=1e-4), n
    with torch.no_grad():  # no gradients (the reference): nothing to keep, whatever is asked
        frozen = SharedPrefix(model, prefix, keep_graph=True)
    assert frozen._sources == [] and not any(leaf.requires_grad for leaf in frozen._leaves)


def test_update_prefix_keeps_the_graph_where_the_token_cap_counted_it(tiny):
    """update_prefix keeps the prefix's graph over the micro-batches exactly where every
    micro-batch's counted positions (`encoded_positions`: the prefix once, rows × the longest
    remainder) are within the cap, or there is no cap."""
    from keel.logprobs import encoded_positions, update_prefix

    m = copy.deepcopy(tiny[0]).train()
    system = list(range(100, 140))  # 40 positions ≥ MIN_SHARED_PREFIX
    rows = [system + [1000 + i] * 20 for i in range(2)] + [system + [2000 + i] * 30 for i in range(2)]
    parts = [[0, 1], [2, 3]]
    # [0, 1]: 40 + 2 × 20 = 80; [2, 3]: 40 + 2 × 30 = 100; one row: its length
    assert [encoded_positions([rows[i] for i in p]) for p in parts] == [80, 100]
    assert encoded_positions([rows[2]]) == 70 and encoded_positions([[1] * 5, [2] * 9]) == 18  # no prefix shared: 2 × 9
    assert update_prefix(m, rows, parts, max_tokens=100)._sources
    assert update_prefix(m, rows, parts, max_tokens=0)._sources
    assert not update_prefix(m, rows, parts, max_tokens=99)._sources  # [2, 3] is over it
    assert not update_prefix(m, rows, parts, max_tokens=0, keep_graph=False)._sources  # model.recompute_shared_prefix
    assert not update_prefix(m, rows, [[0], [1], [2], [3]], max_tokens=69)._sources  # single rows over the cap


@pytest.mark.parametrize("autocast", [False, True])
def test_packed_rows_give_the_padded_rows_values_and_gradients(tiny, autocast):
    """_hidden_states_of runs a micro-batch's right-padded rows packed (their real positions as
    one row, `_packed_attention` spreading them back for the attention): log-probs and weight
    gradients equal the padded rows' (KEEL_PACK_ROWS=0) — with no shared prefix, with rows
    sharing a question, and on top of an update's SharedPrefix; in fp32 (SDPA with the packed
    rows' mask) and under bf16 autocast (Keel's bf16 kernel where the CPU has it). The
    embedding sees only real positions."""
    from keel.logprobs import SharedPrefix

    model, _ = tiny
    g = torch.Generator().manual_seed(11)
    system = torch.randint(5, 200, (40,), generator=g).tolist()
    question = torch.randint(5, 200, (36,), generator=g).tolist()
    cases = {
        "plain": [torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 17, 4)],
        "question": [system + question + torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 17, 4)],
        "prefix": [system + question + torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 17, 4)],
    }

    def run(case: str, pack: bool):
        m = copy.deepcopy(model).train()
        seen = []
        hook = m.get_input_embeddings().register_forward_hook(lambda mod, args, out: seen.append(args[0].numel()))
        rows = cases[case]
        ids, attn, tmask = _right_padded(rows, first_target=3 if case == "plain" else 41, also=2)
        with pytest.MonkeyPatch.context() as mp, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            mp.setenv("KEEL_PACK_ROWS", "1" if pack else "0")
            pre = SharedPrefix(m, system) if case == "prefix" else None
            lp, _ = token_logprobs(m, ids, attn, tmask, prefix=pre)
            (lp.float() * torch.cos(ids[tmask].float())).sum().backward()
            if pre is not None:
                pre.backward()
        hook.remove()
        return lp.detach().float(), {n: p.grad for n, p in m.named_parameters()}, sum(seen)

    lengths = [len(r) for r in cases["plain"]]
    for case in cases:
        v0, g0, n0 = run(case, pack=False)
        v1, g1, n1 = run(case, pack=True)
        padded = {"plain": 3 * 17, "question": 76 + 3 * 17, "prefix": 40 + 36 + 3 * 17 + 40}[case]
        packed = {"plain": sum(lengths), "question": 76 + sum(lengths), "prefix": 40 + 36 + sum(lengths) + 40}[case]
        assert (n0, n1) == (padded, packed), case
        tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-4)
        assert torch.allclose(v0, v1, **tol), case
        for n in g0:
            assert torch.allclose(g0[n], g1[n], **tol), (case, n)


def test_batch_to_moves_every_field():
    # grpo_update moves each collated micro-batch to the model's device (a CUDA model got CPU
    # tensors before, found on the device tool's H200); on CPU the move keeps every value
    from dataclasses import fields

    from keel.logprobs import Batch, collate
    from keel.types import Source, Trajectory

    tr = Trajectory(task_id="t", token_ids=[5, 6, 7, 8], sources=[Source.PROMPT, Source.POLICY, Source.TOOL, Source.POLICY], logprobs=[0.0, -0.5, 0.0, -1.5])
    batch = collate([tr], advantages=[2.0])
    moved = batch.to("cpu")
    assert [f.name for f in fields(Batch)] == ["input_ids", "attention_mask", "target_mask", "old_logprobs", "advantages", "sources"]
    for f in fields(Batch):
        assert torch.equal(getattr(moved, f.name), getattr(batch, f.name)), f.name
    assert moved.old_logprobs.tolist() == [[0.0, -0.5, 0.0, -1.5]] and moved.target_mask.tolist() == [[False, True, False, True]]


def test_sparse_embedding_grads_give_the_dense_gradient(tiny):
    """Under `sparse_embedding_grads` the embedding's backward is sparse; the gradients after the
    block equal the dense ones (tied head: the head's dense gradient and the embedding's rows
    summed; body only: the sparse rows alone, made dense on exit), and the switch is undone."""
    from keel.models import sparse_embedding_grads

    model, _ = tiny
    model = copy.deepcopy(model).train()
    emb = model.get_input_embeddings()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 1000, (2, 24), generator=g)
    ids[1, 3] = ids[0, 7] = ids[0, 2]  # a token seen three times: its row sums three gradients
    attn = torch.ones_like(ids)
    tmask = torch.zeros_like(ids, dtype=torch.bool)
    tmask[:, 12:] = True
    body = getattr(model, model.base_model_prefix)

    def grads(sparse: bool, head: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with sparse_embedding_grads(model) if sparse else contextlib.nullcontext():
            assert emb.sparse == sparse
            for rows in ([0], [1]):  # two backward passes accumulate, as micro-batches do
                if head:
                    logp, _ = token_logprobs(model, ids[rows], attn[rows], tmask[rows], temperature=0.7)
                    (logp * torch.linspace(-1.0, 1.0, logp.numel())).sum().backward()
                else:
                    body(input_ids=ids[rows]).last_hidden_state.pow(2).mean().backward()
        assert not emb.sparse
        return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    for head in (True, False):
        dense, sparse = grads(False, head), grads(True, head)
        assert dense.keys() == sparse.keys()
        for k in dense:
            assert not sparse[k].is_sparse, k
            assert torch.allclose(dense[k], sparse[k], atol=1e-7, rtol=1e-5), (head, k)


# --------------------------------------------------------------------------------------------
# The bf16 training attention (keel/decode_ops.c keel_train_attention, through _NativeAttention)
# --------------------------------------------------------------------------------------------
import math  # noqa: E402


import keel.logprobs as logprobs  # noqa: E402
from keel import native  # noqa: E402

_LIB = native.ops()
needs_bf16_attention = pytest.mark.skipif("dpbf16" not in native.bf16_kernels(_LIB), reason="no AVX512-BF16 here: SDPA runs")


def _hf_mask(lens: list[int], Tq: int, Tk: int) -> torch.Tensor:
    """The boolean mask transformers builds for right-padded rows after a cached prefix of Tk - Tq
    positions: query t sees key j where j ≤ Tk - Tq + t and j < the row's length."""
    t, j = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
    return torch.stack([(j <= Tk - Tq + t) & (j < n) for n in lens])[:, None]


def test_visible_keys_reads_the_masks_keel_builds_and_refuses_others():
    # prefix of 2 positions, 3 queries; row 0 is 5 long, row 1 is 4 long (its last key is padding)
    mask = _hf_mask([5, 4], 3, 5)
    assert logprobs._visible_keys(mask, False, 2, 3, 5).tolist() == [[3, 4, 5], [3, 4, 4]]
    assert logprobs._visible_keys(mask, False, 2, 3, 5).tolist() == [[3, 4, 5], [3, 4, 4]]  # kept on the mask
    assert logprobs._visible_keys(None, True, 2, 3, 3).tolist() == [[1, 2, 3], [1, 2, 3]]
    assert logprobs._visible_keys(None, False, 1, 2, 4).tolist() == [[4, 4]]
    assert logprobs._visible_keys(_hf_mask([5], 3, 5), False, 2, 3, 5).tolist() == [[3, 4, 5], [3, 4, 5]]  # broadcast row
    holed = _hf_mask([5, 4], 3, 5)
    holed[0, 0, 1, 0] = False
    assert logprobs._visible_keys(holed, False, 2, 3, 5) is None
    blind = _hf_mask([5, 4], 3, 5)
    blind[1, 0, 2] = False
    assert logprobs._visible_keys(blind, False, 2, 3, 5) is None
    assert logprobs._visible_keys(torch.zeros(2, 1, 3, 5), False, 2, 3, 5) is None  # an additive float mask
    assert logprobs._visible_keys(_hf_mask([5, 4], 3, 5).expand(2, 2, 3, 5), False, 2, 3, 5) is None  # one per head


def _attention_errors(B, H, KV, Tq, Tk, D, lens, seed=0):
    """Relative errors against float64 of (output, dq, dk, dv) from the native kernel and from
    torch's bf16 SDPA on the same bf16 inputs and output gradient, and the native log-sum-exp's
    largest error."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g).bfloat16() for h, T in ((H, Tq), (KV, Tk), (KV, Tk)))
    grad = torch.randn(B, Tq, H, D, generator=g).bfloat16()
    mask = _hf_mask(lens, Tq, Tk)
    scale = D ** -0.5

    def run(dtype, native_kernel):
        x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]  # clone: .to() of a bf16 tensor is itself
        if native_kernel:
            out = logprobs._NativeAttention.apply(*x, logprobs._visible_keys(mask, False, B, Tq, Tk), scale, _LIB)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)
        out.backward(grad.to(dtype))
        return [out.detach().double()] + [t.grad.double() for t in x]

    exact, ours, torchs = run(torch.float64, False), run(torch.bfloat16, True), run(torch.bfloat16, False)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    scores = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double().repeat_interleave(H // KV, 1)) * scale
    lse_exact = torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1)
    with torch.enable_grad():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        visible = logprobs._visible_keys(mask, False, B, Tq, Tk)
        out = logprobs._NativeAttention.apply(*x, visible, scale, _LIB)
    lse = out.grad_fn.saved_tensors[5]
    return [rel(a, e) for a, e in zip(ours, exact)], [rel(a, e) for a, e in zip(torchs, exact)], (lse.double() - lse_exact).abs().max().item()


@needs_bf16_attention
@pytest.mark.parametrize("shape", [
    (2, 9, 3, 33, 70, 64, [70, 55]),  # SmolLM2's heads, a cached prefix of 37 positions, a padded row
    (2, 3, 1, 20, 37, 64, [37, 30]),
    (3, 4, 2, 17, 17, 32, [17, 9, 1]),  # no prefix; a row of one token
    (1, 8, 1, 40, 100, 128, [100]),
])
def test_bf16_training_attention_is_as_close_to_float64_as_torchs_bf16(shape):
    """keel_train_attention rounds its probabilities and dS to bf16 before their products (as
    FlashAttention-2 does); torch's CPU flash kernel keeps them in fp32. Output and gradients stay
    within 1.5× torch's bf16 error (both ~2-3e-3 relative, the inputs' own rounding), the
    log-sum-exp within 1e-5."""
    ours, torchs, lse_err = _attention_errors(*shape)
    for name, a, t in zip(("out", "dq", "dk", "dv"), ours, torchs):
        assert a <= 1.5 * t and a < 5e-3, (name, a, t)
    assert lse_err < 1e-5


@needs_bf16_attention
def test_bf16_training_attention_gives_the_same_bits_on_any_number_of_threads():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 6, 40, 64, generator=g).bfloat16(), torch.randn(2, 2, 57, 64, generator=g).bfloat16(), torch.randn(2, 2, 57, 64, generator=g).bfloat16()
    grad = torch.randn(2, 40, 6, 64, generator=g).bfloat16()
    visible = logprobs._visible_keys(_hf_mask([57, 50], 40, 57), False, 2, 40, 57)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = logprobs._NativeAttention.apply(*x, visible, 0.125, _LIB)
            out.backward(grad)
            results.append([out.detach()] + [t.grad for t in x])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def _gqa_model():
    """A 2-layer Llama in training mode with head dim 32 (what the native training kernels take):
    3 query heads, 1 key/value head; and the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from keel.models import load_tokenizer

    tok = load_tokenizer("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train(), tok


@needs_bf16_attention
def test_logprobs_under_bf16_autocast_run_the_native_attention(monkeypatch):
    """token_logprobs of a grouped-query model under bf16 autocast (head dim 32, the shared prefix
    and padding of _batch) goes through _NativeAttention in every layer's forwards, and its
    log-probs and gradients are SDPA's up to bf16 rounding (KEEL_TRAIN_ATTENTION=0 keeps SDPA)."""
    model, tok = _gqa_model()
    ids, attn, target, _ = _batch(tok)
    calls = []
    apply = logprobs._NativeAttention.apply
    monkeypatch.setattr(logprobs._NativeAttention, "apply", lambda *a: calls.append(a[0].shape) or apply(*a))

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = token_logprobs(model, ids, attn, target, 1.0)
        lp.sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    lp_native, g_native = run()
    assert len(calls) == 2 * model.config.num_hidden_layers  # the shared prefix's forward and the rows' own, each layer
    monkeypatch.setenv("KEEL_TRAIN_ATTENTION", "0")
    calls.clear()
    lp_sdpa, g_sdpa = run()
    assert not calls
    assert (lp_native - lp_sdpa).abs().max() < 0.01 and (lp_native - lp_sdpa).abs().mean() < 0.002  # measured 0.0015, 0.0004
    assert (g_native - g_sdpa).norm() / g_sdpa.norm() < 0.02  # measured 0.003


@needs_bf16_attention
def test_packed_rows_run_the_native_attention_with_the_padded_rows_values(monkeypatch):
    """Under bf16 autocast, rows run packed (`_packed_attention`) go through _NativeAttention in
    every layer as the padded rows do, with the same log-probs and gradients up to the products'
    rounding; the rows' projections see only their real positions."""
    model, tok = _gqa_model()
    ids, attn, target, _ = _batch(tok)
    calls, rows = [], []
    apply = logprobs._NativeAttention.apply
    monkeypatch.setattr(logprobs._NativeAttention, "apply", lambda *a: calls.append(a[0].shape) or apply(*a))
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[:-1].numel()))

    def run(pack: str):
        monkeypatch.setenv("KEEL_PACK_ROWS", pack)
        model.zero_grad()
        calls.clear(), rows.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = token_logprobs(model, ids, attn, target, 1.0)
        (lp * torch.cos(ids[target].float())).sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), list(calls), list(rows)

    lp_pad, g_pad, calls_pad, rows_pad = run("0")
    lp_packed, g_packed, calls_packed, rows_packed = run("1")
    shared, lengths = shared_prefix_len(ids, attn), attn.sum(-1)
    assert rows_pad == [shared, ids.numel() - 4 * shared] and rows_packed == [shared, int((lengths - shared).sum())]
    assert len(calls_packed) == len(calls_pad) == 2 * model.config.num_hidden_layers
    # measured: log-probs 0.0 apart; gradients 1.4e-3 (relative) — the weight gradients' products
    # sum over other rows (padding's zeros gone) and are rounded to bf16 under autocast
    assert (lp_packed - lp_pad).abs().max() < 1e-3
    assert (g_packed - g_pad).norm() / g_pad.norm() < 5e-3


needs_native = pytest.mark.skipif(_LIB is None, reason="no native kernels here (no C compiler): torch's ops run")


def _rotary_inputs(B: int, T: int, cos_rows: int, seed: int = 13):
    """Leaf x [B, T, 96] and projections to 3 query heads and 1 key head of 32 (their outputs
    transposed to [B, heads, T, 32], as transformers' attention lays them out), and Llama's cos,
    sin [cos_rows, T, 32] for positions 5 .. 5+T-1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 96, generator=g)
    wq, wk = torch.randn(96, 96, generator=g) / 10, torch.randn(32, 96, generator=g) / 10
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    freqs = (torch.arange(5, 5 + T).float()[:, None] * inv).expand(cos_rows, T, 16)
    emb = torch.cat([freqs, freqs], -1)
    return x, wq, wk, emb.cos(), emb.sin(), [torch.randn(B, 3, T, 32, generator=g), torch.randn(B, 1, T, 32, generator=g)]


@needs_native
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("B,T,cos_rows", [(1, 7, 1), (3, 20, 3), (2, 9, 1)])
def test_native_rotary_is_transformers_bit_for_bit(autocast, B, T, cos_rows):
    """keel_rotary (`_NativeRotary`) gives transformers' apply_rotary_pos_emb's q and k and
    their gradients through the projections bit for bit, in fp32 and under bf16 autocast (bf16
    projections, fp32 rotary), cos and sin per row or broadcast; its output has the same layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def native(q, k, cos, sin):
        assert logprobs._rotary_ready(q, k, cos, sin)
        return logprobs._NativeRotary.apply(q, cos, sin, _LIB), logprobs._NativeRotary.apply(k, cos, sin, _LIB)

    results = []
    for fn in (apply_rotary_pos_emb, native):
        x, wq, wk, cos, sin, weights = _rotary_inputs(B, T, cos_rows)
        for t in (x, wq, wk):
            t.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            q = torch.nn.functional.linear(x, wq).view(B, T, 3, 32).transpose(1, 2)
            k = torch.nn.functional.linear(x, wk).view(B, T, 1, 32).transpose(1, 2)
            qe, ke = fn(q, k, cos, sin)
        assert q.dtype == (torch.bfloat16 if autocast else torch.float32) and qe.dtype == torch.float32
        ((qe * weights[0]).sum() + (ke * weights[1]).sum()).backward()
        results.append([qe.detach(), ke.detach(), x.grad, wq.grad, wk.grad])
    hf, ours = results
    assert hf[0].stride() == ours[0].stride()
    for a, b in zip(hf, ours):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("autocast", [False, True])
def test_training_forwards_run_the_native_rotary_and_change_no_bit(monkeypatch, autocast):
    """token_logprobs with a shared prefix (head dim 32) runs `_NativeRotary` for q and k in every
    layer of both of its forwards, and gives the same log-probs and gradients, bit for bit, as
    transformers' own rotary (the model's module taken off ROTARY_MODULES); the module's function
    is its own again afterwards, and inputs the kernel does not take go to it."""
    import transformers.models.llama.modeling_llama as llama
    model, tok = _gqa_model()
    ids, attn, target, _ = _batch(tok)
    calls = []
    apply = logprobs._NativeRotary.apply
    monkeypatch.setattr(logprobs._NativeRotary, "apply", lambda *a: calls.append(a[0].shape) or apply(*a))
    original = llama.apply_rotary_pos_emb

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, _ = token_logprobs(model, ids, attn, target, 1.0)
        lp.sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    lp_native, g_native = run()
    assert len(calls) == 2 * 2 * model.config.num_hidden_layers  # q and k; the shared prefix's forward and the rows' own
    assert llama.apply_rotary_pos_emb is original
    monkeypatch.setattr(logprobs, "ROTARY_MODULES", ())
    calls.clear()
    lp_hf, g_hf = run()
    assert not calls
    assert torch.equal(lp_native, lp_hf) and torch.equal(g_native, g_hf)
    monkeypatch.undo()
    with logprobs._native_rotary(model.model):  # q, k as [B, T, heads, D]: transformers' function takes them
        q, k = torch.randn(2, 5, 3, 32), torch.randn(2, 5, 1, 32)
        cos, sin = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
        assert all(torch.equal(a, b) for a, b in zip(llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2),
                                                     original(q, k, cos, sin, unsqueeze_dim=2)))
    assert llama.apply_rotary_pos_emb is original


def _chunk_by_autograd(logits, targets, temperature: float):
    """A chunk's log-probs and entropies as plain autograd ops (what `_HeadLogprobs` stands for)."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_equal_autograd_bit_for_bit(dtype, temperature):
    """`_HeadLogprobs` (work buffers kept across calls, log-softmax recomputed in backward) gives
    the plain ops' log-probs, entropies and logit gradients to the last bit, chunk after chunk."""
    g = torch.Generator().manual_seed(0)
    for rows in (37, 5, 37):  # the buffers grown, then used in part, then again in whole
        logits = (torch.randn(rows, 1000, generator=g) * 4).to(dtype).requires_grad_()
        targets = torch.randint(0, 1000, (rows,), generator=g)
        weights = torch.randn(rows, generator=g)
        lp, ent = logprobs._HeadLogprobs.apply(logits, targets, temperature, True)
        (lp * weights).sum().backward()
        ours = logits.grad
        logits.grad = None
        want_lp, want_ent = _chunk_by_autograd(logits, targets, temperature)
        (want_lp * weights).sum().backward()
        assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent) and torch.equal(ours, logits.grad)
        assert ours.dtype == dtype and lp.requires_grad and not ent.requires_grad


def test_head_logprobs_gradients_are_not_the_work_buffers():
    """A gradient handed to autograd is its own tensor: a later chunk's backward, which reuses the
    buffers, leaves an earlier gradient as it was (fp32 logits, where no cast copies it)."""
    g = torch.Generator().manual_seed(1)
    first = torch.randn(8, 300, generator=g, requires_grad=True)
    logprobs._HeadLogprobs.apply(first, torch.arange(8), 1.0, False)[0].sum().backward()
    kept = first.grad.clone()
    second = torch.randn(8, 300, generator=g, requires_grad=True)
    logprobs._HeadLogprobs.apply(second, torch.arange(8) + 8, 1.0, False)[0].sum().backward()
    assert torch.equal(first.grad, kept) and not torch.equal(second.grad, kept)


# --------------------------------------------------------------------------------------------
# The LM head over a micro-batch in one product, its weight's gradient added in place (_HeadProduct)
# --------------------------------------------------------------------------------------------
def _head_case(seed: int, n: int = 37, vocab: int = 1000, hidden: int = 48):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.3)
    h = torch.randn(n, hidden, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(n, generator=g)
    return head, h, targets, weights


def _fused(head, h, targets, temperature, chunk=16, dtype=None):
    from keel import logprobs

    compute = logprobs._cast_weight(head.weight, dtype or head.weight.dtype)
    return logprobs._HeadProduct.apply(h, head.weight, compute, targets, temperature, True, chunk)


@pytest.mark.parametrize("start", ["none", "dense", "sparse"])
def test_head_product_equals_autograd_in_fp32(monkeypatch, start):
    """In fp32, `_HeadProduct`'s log-probs, entropies, h gradient and weight gradient equal plain
    autograd's (F.linear, log-softmax, gather) over several chunks and weight-row blocks with a
    remainder, the weight's gradient added to what `.grad` held before: nothing, a dense
    gradient, or the sparse rows a tied embedding leaves."""
    from keel import logprobs

    monkeypatch.setattr(logprobs, "_HEAD_GRAD_BLOCK", 7 * 48)  # blocks of 7 rows: 1000 = 142 · 7 + 6
    head, h, targets, weights = _head_case(0)
    before = {"none": None, "dense": torch.randn(1000, 48),
              "sparse": torch.sparse_coo_tensor(torch.tensor([[3, 3, 999]]), torch.randn(3, 48), (1000, 48), check_invariants=True)}[start]

    def run(fused: bool):
        x = h.clone().requires_grad_()
        head.weight.grad = None if before is None else before.clone()
        lp, ent = _fused(head, x, targets, 0.7) if fused else _chunk_by_autograd(head(x), targets, 0.7)
        (lp * weights).sum().backward()
        return lp.detach(), ent, x.grad, head.weight.grad

    ours, plain = run(True), run(False)
    for a, b, what in zip(ours, plain, ("logp", "entropy", "h grad", "weight grad")):
        assert not a.is_sparse and a.dtype == b.dtype, what
        torch.testing.assert_close(a, b.to_dense(), rtol=1e-6, atol=1e-7, msg=what)


def test_head_product_under_autocast_rounds_less_than_autograd():
    """Under bf16 autocast the weight's gradient is one product over the micro-batch's rows summed
    into fp32, where autograd summed a bf16 product per chunk in bf16 and then cast it: against
    the same computation in float64 (the bf16 inputs widened) ours is closer, and the log-probs
    and h gradient are autograd's within bf16 rounding (relative error of the weight's gradient)."""
    head, h, targets, weights = _head_case(1, n=200)
    x64, w64 = h.bfloat16().double().requires_grad_(), head.weight.detach().bfloat16().double().requires_grad_()
    lp64 = torch.log_softmax((x64 @ w64.t()) / 0.7, -1).gather(1, targets[:, None])[:, 0]
    (lp64 * weights.double()).sum().backward()

    def run(fused: bool):
        x = h.clone().requires_grad_()
        head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                lp, _ = _fused(head, x, targets, 0.7, chunk=16, dtype=torch.bfloat16)
            else:
                lp = torch.cat([_chunk_by_autograd(head(x[s : s + 16]), targets[s : s + 16], 0.7)[0] for s in range(0, 200, 16)])
        (lp * weights).sum().backward()
        return lp.detach(), x.grad, head.weight.grad

    (lp_f, gh_f, gw_f), (lp_a, gh_a, gw_a) = run(True), run(False)
    assert gw_f.dtype == torch.float32 and gh_f.dtype == torch.float32
    err = lambda a: float((a.double() - w64.grad).norm() / w64.grad.norm())  # noqa: E731
    assert err(gw_f) < err(gw_a)  # 0.0049 against 0.0060 (the logits' and their gradients' bf16 roundings are common to both)
    torch.testing.assert_close(lp_f, lp_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(gh_f, gh_a, rtol=1e-2, atol=1e-3)


def test_head_product_logits_buffer_is_shared_only_between_finished_passes():
    """The logits buffer serves one graph at a time: two forwards before their backward passes get
    their own storage (the gradients are the plain ones), a second backward through one graph is
    refused, and once a graph's backward has run the next forward reuses the buffer."""
    from keel import logprobs

    head, h, targets, weights = _head_case(2)
    want = {}
    for name, rows in (("a", slice(0, 20)), ("b", slice(20, 37))):
        head.weight.grad = None
        lp, _ = _chunk_by_autograd(head(h[rows]), targets[rows], 1.0)
        (lp * weights[rows]).sum().backward()
        want[name] = head.weight.grad.clone()
    head.weight.grad = None
    lp_a, _ = _fused(head, h[:20], targets[:20], 1.0)
    buffer_a = logprobs._SCRATCH.logits[0].data_ptr()
    lp_b, _ = _fused(head, h[20:], targets[20:], 1.0)
    assert logprobs._SCRATCH.logits[0].data_ptr() == buffer_a  # b did not take a's buffer
    (lp_a * weights[:20]).sum().backward(retain_graph=True)
    torch.testing.assert_close(head.weight.grad, want["a"], rtol=1e-6, atol=1e-7)
    (lp_b * weights[20:]).sum().backward()
    torch.testing.assert_close(head.weight.grad, want["a"] + want["b"], rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="second backward"):
        (lp_a * weights[:20]).sum().backward()
    lp_c, _ = _fused(head, h[:20], targets[:20], 1.0)
    assert logprobs._SCRATCH.logits[0].data_ptr() == buffer_a


def test_head_cast_follows_the_weight_and_ends_with_the_passes(tiny):
    """Inside `training_passes` the head's bf16 cast is made once and made again after the weight
    changes (an optimizer step between two updates' forwards would); when the passes end it is
    dropped. The log-probs equal a fresh cast's."""
    from keel import logprobs
    from keel.logprobs import training_passes

    model, _ = tiny
    model = copy.deepcopy(model).train()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 1000, (1, 24), generator=g)
    attn = torch.ones_like(ids)
    tmask = torch.zeros_like(ids, dtype=torch.bool)
    tmask[:, 12:] = True
    weight = model.get_output_embeddings().weight
    with training_passes(model, True):
        first = token_logprobs(model, ids, attn, tmask)[0].detach()  # its graph freed: the logits buffer is free again
        cast = logprobs._CAST_WEIGHTS[id(weight)][3]
        again = token_logprobs(model, ids, attn, tmask)[0].detach()
        assert logprobs._CAST_WEIGHTS[id(weight)][3] is cast and torch.equal(first, again)
        with torch.no_grad():
            weight.mul_(1.5)
        moved = token_logprobs(model, ids, attn, tmask)[0].detach()
        assert logprobs._CAST_WEIGHTS[id(weight)][3] is not cast and not torch.equal(moved, first)
    assert not logprobs._CAST_WEIGHTS and logprobs._SCRATCH.logits is None
    with training_passes(model, True):
        fresh = token_logprobs(model, ids, attn, tmask)[0].detach()
    assert torch.equal(moved, fresh)


@pytest.mark.parametrize("autocast", [False, True])
def test_head_without_grad_equals_the_head_chunk_by_chunk(tiny, autocast):
    """Without gradients (the KL reference's pass) each chunk's logits go into one reused buffer;
    the log-probs and entropies are the head's own chunk by chunk, bit for bit (a reference whose
    head is stored in bf16 under autocast, or the fp32 model)."""
    from keel.logprobs import _hidden_states
    from keel.models import frozen_reference

    model, _ = tiny
    ref = frozen_reference(copy.deepcopy(model), autocast)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(5, 1000, (2, 30), generator=g)
    attn = torch.ones_like(ids)
    tmask = torch.zeros_like(ids, dtype=torch.bool)
    tmask[:, 5:] = True  # 50 targets: chunks of 16, 16, 16 and 2
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lp, ent = token_logprobs(ref, ids, attn, tmask, temperature=0.7, chunk=16, with_entropy=True)
        hidden = _hidden_states(getattr(ref, ref.base_model_prefix), ids, attn)
        prev = torch.zeros_like(tmask)
        prev[:, :-1] = tmask[:, 1:]
        h, targets = hidden[prev], ids[tmask]
        head = ref.get_output_embeddings()
        want = [_chunk_by_autograd(head(h[s : s + 16]), targets[s : s + 16], 0.7) for s in range(0, 50, 16)]
    assert head.weight.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(lp, torch.cat([w[0] for w in want])) and torch.equal(ent, torch.cat([w[1] for w in want]))


def test_head_product_under_autocast_accumulates_exactly(monkeypatch):
    """Under bf16 autocast two micro-batches' passes leave in `.grad` exactly the fp32 sum of what
    each leaves alone (each block's bf16 product widened, then added), over weight-row blocks
    with a remainder."""
    from keel import logprobs

    monkeypatch.setattr(logprobs, "_HEAD_GRAD_BLOCK", 7 * 48)
    head, h, targets, weights = _head_case(3)
    parts = (slice(0, 20), slice(20, 37))

    def backward(rows):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = _fused(head, h[rows].clone().requires_grad_(), targets[rows], 0.7, dtype=torch.bfloat16)
        (lp * weights[rows]).sum().backward()

    alone = []
    for rows in parts:
        head.weight.grad = None
        backward(rows)
        alone.append(head.weight.grad.clone())
    head.weight.grad = None
    for rows in parts:
        backward(rows)
    assert head.weight.grad.dtype == torch.float32
    assert torch.equal(head.weight.grad, alone[0] + alone[1])
