"""Shared-prefix ("cascade") attention for rollouts: the prompt prefix every row of a batch shares
is stored once and read once per step, not once per row.

A rollout batch is usually one or a few prompts repeated (a GRPO group), and on the KG task the
shared system block with the tool schemas is ~560 of a prompt's ~620 tokens. A batched KV
cache that repeats that block per row makes each decode step read it B times; on this CPU
decode attention runs at ~8–10 GB/s, so at batch 16 the repeated prefix is most of the
attention time (`bench/sampler_vs_generate.py`). Here each layer keeps the prefix's keys and
values once ([1, kv_heads, P, D]) next to the rows' own growing cache, and attention is split:

- prefix part: every query of every row against the one prefix, as a single attention call
  whose "query length" is all rows' queries stacked (no mask: every row sees the whole prefix);
- row part: each row's queries against its own keys, with the model's mask (holes, causality);
- the two are merged exactly with their log-sum-exps (as in flash-decoding):
  out = (o_p·e^(l_p−m) + o_r·e^(l_r−m)) / (e^(l_p−m) + e^(l_r−m)), m = max(l_p, l_r).

Both parts use torch's CPU flash-attention kernel, which returns the log-sum-exp. On other
devices, or when a layer has no prefix, the call goes to transformers' SDPA attention unchanged.
`tests/test_cascade.py` checks the split against one SDPA call over the repeated cache.
"""

from __future__ import annotations

import contextlib
import functools

import torch

NAME = "keel_cascade"


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive: torch.Tensor | None, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Q, D], lse [B, H, Q] fp32); `additive`: 0 where visible, −inf elsewhere, or None."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=additive, scale=scale)


def _rows_mask(mask: torch.Tensor | None, rep: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' own-key mask as the kernel takes it, for grouped query heads: (additive mask
    [B, 1, rep·Q, L] in `dtype`, bool [B, 1, rep·Q] "sees at least one own key"), or (None, None).
    The same for every layer of a forward, so `attention` computes it once per forward."""
    if mask is None:
        return None, None
    B, _, Q, L = mask.shape
    grouped = mask[:, :, None].expand(B, 1, rep, Q, L).reshape(B, 1, rep * Q, L)
    additive = torch.zeros(grouped.shape, dtype=dtype, device=mask.device).masked_fill_(~grouped, float("-inf"))
    return additive, grouped.any(-1)


def split_attention(query: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, scale: float | None,
                    prepared: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Attention of `query` over [prefix ‖ own keys], the prefix shared by the whole batch.

    query [B, H, Q, D]; prefix_k/v [1, KV, P, D]; key/value [B, KV, L, D] (H = KV · n_rep, query
    head h reads kv head h // n_rep); mask: bool [B, 1, Q, L] over the rows' own keys (True =
    attend) or None (all visible); `prepared`: `_rows_mask(mask, ...)` if already computed.
    Returns [B, H, Q, D].
    """
    B, H, Q, D = query.shape
    KV = key.shape[1]
    rep = H // KV
    grouped = query.reshape(B, KV, rep * Q, D)  # row index r·Q + t: query head kv·rep + r, position t
    # prefix: all rows' queries of a kv head as one long query block against the single prefix
    stacked = grouped.transpose(0, 1).reshape(1, KV, B * rep * Q, D)
    out_p, lse_p = _flash(stacked, prefix_k, prefix_v, None, scale)
    out_p = out_p.reshape(KV, B, rep * Q, D).transpose(0, 1)
    lse_p = lse_p.reshape(KV, B, rep * Q).transpose(0, 1)
    # own keys: grouped query heads share their kv head's mask
    additive, seen = prepared if prepared is not None else _rows_mask(mask, rep, query.dtype)
    out_r, lse_r = _flash(grouped, key, value, additive, scale)
    if seen is not None:  # a query that sees none of its own keys (a hole) gets lse 0 from the kernel, not −inf
        lse_r = lse_r.masked_fill(~seen.expand_as(lse_r), float("-inf"))
    m = torch.maximum(lse_p, lse_r)
    w_p = torch.exp(lse_p - m)[..., None]
    w_r = torch.exp(lse_r - m)[..., None]
    out = (out_p.float() * w_p + out_r.float() * w_r) / (w_p + w_r)
    return out.to(query.dtype).reshape(B, H, Q, D)


def _own_mask(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, P: int) -> torch.Tensor | None:
    """The model's mask over [prefix ‖ own keys] cut to the own keys, boolean, one row per query row."""
    mask = attention_mask
    if mask is not None:
        if mask.shape[-1] != P + key.shape[2]:
            raise RuntimeError(f"keel.cascade: mask covers {mask.shape[-1]} keys, the layer has {P} shared + {key.shape[2]} own")
        if mask.dtype != torch.bool:  # an additive mask: 0 where visible
            mask = mask == 0
        mask = mask[..., P:]
        if mask.shape[0] != query.shape[0]:
            mask = mask.expand(query.shape[0], *mask.shape[1:])
    elif query.shape[2] > 1:  # no mask with several queries: causal over the rows' own keys
        Q, L = query.shape[2], key.shape[2]
        mask = (torch.arange(L, device=query.device)[None, :] <= torch.arange(L - Q, L, device=query.device)[:, None])[None, None]
        mask = mask.expand(query.shape[0], 1, Q, L)
    return mask


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """A transformers attention function (registered as NAME): split attention when the layer's
    cache holds a shared prefix, transformers' SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = kwargs.get("keel_cache")
    prefix = None
    if cache is not None and query.device.type == "cpu":
        prefix = getattr(cache.layers[module.layer_idx], "prefix", None)
    if prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # every layer of one forward gets the same mask object: prepare it for the kernel once
    memo = getattr(cache, "_keel_rows_mask", None)
    if attention_mask is not None and memo is not None and memo[0] is attention_mask:
        prepared = memo[1]
    else:
        mask = _own_mask(attention_mask, query, key, prefix[0].shape[-2])
        prepared = _rows_mask(mask, query.shape[1] // key.shape[1], query.dtype)
        cache._keel_rows_mask = (attention_mask, prepared)
    out = split_attention(query, prefix[0], prefix[1], key, value, None, scaling, prepared)
    return out.transpose(1, 2).contiguous(), None


def available() -> bool:
    """Whether this torch has the CPU flash-attention op that returns the log-sum-exp."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


@functools.cache
def _register(name: str, function) -> None:
    """Register `function` with transformers as attention `name`, with SDPA's mask (once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


@contextlib.contextmanager
def in_place_of_sdpa(config, name: str, function):
    """Run with `function` (a transformers attention function, registered as `name`) where the
    model's config uses SDPA; a config on another implementation (eager, flash) is left as it is.
    Keel's two attention functions enter this way: this module's `attention` for rollouts and
    keel.logprobs' training attention."""
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    _register(name, function)
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
