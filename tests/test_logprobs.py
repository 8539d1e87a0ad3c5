"""The shared-prefix forward used in training equals one plain forward: values and gradients."""

import copy

import torch

from keel.logprobs import _hidden_states, shared_prefix_len, token_logprobs


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
