"""Per-token log-probs of stored trajectories under a model, with memory kept small.

A 49k-vocabulary logits tensor for 4k tokens is ~800 MB in fp32, most of a step's memory
(MEASURED.md). Only the positions that predict a trained token need logits, so we run the
decoder body once, gather the hidden states just before each target token, and apply the
LM head in chunks over those rows only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from dataclasses import dataclass, fields

import torch

from keel import cascade, native
from keel.models import autocast_context, sparse_embedding_grads
from keel.types import Source, Trajectory


@dataclass
class Batch:
    """Right-padded token batch. input_ids/attention_mask: [B, T]; target_mask[b, t] marks tokens
    whose log-prob is wanted (predicted from position t-1); old_logprobs/advantages: [B, T]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    sources: torch.Tensor  # [B, T] keel.types.Source of each kept token (-1 on padding)

    def to(self, device: torch.device | str) -> "Batch":
        """The same batch on `device` (collate builds it on the CPU; the model may be on a GPU)."""
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def kept_positions(sources: list[int], drop_sources: tuple[int, ...] = (Source.HINT,)) -> list[int]:
    """Positions of the tokens a trained sequence keeps (hints are dropped, see `collate`)."""
    return [i for i, s in enumerate(sources) if s not in drop_sources]


def collate(
    trajectories: list[Trajectory],
    sources: tuple[int, ...] = (Source.POLICY,),
    pad_id: int = 0,
    advantages: list[float] | None = None,
    drop_sources: tuple[int, ...] = (Source.HINT,),
) -> Batch:
    """Stack trajectories into a right-padded batch; targets = tokens whose source is in `sources`.

    Tokens whose source is in `drop_sources` (hints) are removed first, so they never enter a
    trained sequence and the remaining tokens keep their order.
    Worked example: sources [0,0,3,1,1,2,1] with drop HINT → kept [0,0,1,1,2,1],
    target_mask [F,F,T,T,F,T] (targets at position 0 are impossible and never occur).
    """
    seqs = []
    for tr in trajectories:
        keep = kept_positions(tr.sources, drop_sources)
        seqs.append(
            (
                [tr.token_ids[i] for i in keep],
                [tr.sources[i] for i in keep],
                [tr.logprobs[i] for i in keep],
            )
        )
    T = max(len(s[0]) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    tmask = torch.zeros(B, T, dtype=torch.bool)
    old = torch.zeros(B, T)
    adv = torch.zeros(B, T)
    src = torch.full((B, T), -1, dtype=torch.long)
    for b, (tok, srcs, lps) in enumerate(seqs):
        n = len(tok)
        ids[b, :n] = torch.tensor(tok)
        attn[b, :n] = 1
        tmask[b, :n] = torch.tensor([s in sources for s in srcs])
        old[b, :n] = torch.tensor(lps)
        src[b, :n] = torch.tensor(srcs)
        if advantages is not None:
            adv[b, :n] = advantages[b]
    tmask[:, 0] = False
    return Batch(ids, attn, tmask, old, adv, src)


TRAINING_ATTENTION = "keel_training_sdpa"


def _training_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention for the log-prob forwards on CPU. Where SDPA would run in bf16
    (bf16 autocast) and the CPU has AVX512-BF16, Keel's own bf16 kernel instead (`_NativeAttention`:
    2× faster, values within bf16 rounding of SDPA's). Otherwise SDPA, with two changes that change
    no value (tests/test_logprobs.py) and only what autograd keeps:
    - grouped-query heads go to SDPA as they are (`enable_gqa`; the CPU flash kernel takes them)
      instead of keys and values repeated to every query head, copies that backward kept
      (~14% of a micro-batch's saved activations for SmolLM2: 9 query heads, 3 kv heads);
    - a boolean mask is turned into the kernel's additive form once per forward, not once per
      layer with a copy per layer kept for backward (the mask object is the same for every
      layer; the additive one is memoised on it).
    Other devices, and attention that is not plain (sliding windows, softcaps, sinks), keep
    transformers' SDPA."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = not any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "s_aux", "position_bias"))
    layout = getattr(_PACKING, "layout", None)
    if layout is not None and query.shape[0] == 1 and query.shape[2] == layout.index.numel():
        if query.device.type != "cpu" or not plain or dropout != 0.0 or query.shape[1] != key.shape[1] * groups:
            raise RuntimeError("keel.logprobs: packed rows reached an attention layer that is not plain causal attention on the CPU")
        return _packed_attention(query, key, value, layout, scaling, groups), None
    if query.device.type != "cpu" or not plain or query.shape[1] != key.shape[1] * groups:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if dropout == 0.0 and (lib := _bf16_training_kernels(query, key, value)) is not None:
        visible = _visible_keys(attention_mask, causal, query.shape[0], query.shape[2], key.shape[2])
        if visible is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            bf16 = [t.to(torch.bfloat16) for t in (query, key, value)]  # autocast's casts for SDPA
            return _NativeAttention.apply(*bf16, visible, scale, lib), None
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:
        additive = getattr(mask, "_keel_additive", None)
        if additive is None or additive.dtype != query.dtype:
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            mask._keel_additive = additive
        mask = additive
    if causal and key.shape[2] > query.shape[2]:  # as transformers does: an upper-left causal mask over the first keys
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                           is_causal=causal, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


class _Packed:
    """Where a micro-batch's right-padded rows [B, W] (beyond what they share) go when they run
    packed, as one row of their N real positions: `index` [N], each one's place in the rows
    flattened (b · W + t); `visible` [B, W] int32, t + 1 at a real position (the row's own
    positions it sees), 0 at padding."""

    def __init__(self, keep: torch.Tensor):
        B, W = keep.shape
        self.rows, self.width = B, W
        self.index = keep.flatten().nonzero()[:, 0]
        self.visible = torch.where(keep, torch.arange(1, W + 1, dtype=torch.int32, device=keep.device), 0).to(torch.int32)
        self._seen: dict[int, torch.Tensor] = {}  # keys_seen per P, asked again by every layer
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # additive_mask per (P, dtype)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] packed → [B, W, ...], zero at padding."""
        return x.new_zeros((self.rows * self.width,) + tuple(x.shape[1:])).index_copy(0, self.index, x).view(self.rows, self.width, *x.shape[1:])

    def keys_seen(self, P: int) -> torch.Tensor:
        """[B, W] int32: the keys each query sees after P shared positions (P + t + 1; a padding
        query, one), made once for every layer."""
        if P not in self._seen:
            self._seen[P] = torch.where(self.visible > 0, self.visible + P, 1).to(torch.int32)
        return self._seen[P]

    def additive_mask(self, P: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, W, P + W] SDPA's additive form of `keys_seen` (0 seen, -inf not), made once for every layer."""
        if (P, dtype) not in self._masks:
            seen = torch.arange(P + self.width, device=self.visible.device) < self.keys_seen(P)[..., None]
            self._masks[P, dtype] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))[:, None]
        return self._masks[P, dtype]


_PACKING = threading.local()  # .layout: the _Packed rows the training attention is running, while `_hidden_states_of` runs them


@contextlib.contextmanager
def _packing(layout: _Packed):
    _PACKING.layout = layout
    try:
        yield
    finally:
        _PACKING.layout = None


def _packed_attention(query, key, value, layout: _Packed, scaling: float | None, groups: int) -> torch.Tensor:
    """Attention of packed rows (`_hidden_states_of`): query [1, H, N, D] at the rows' N real
    positions, key and value [1, KV, P + N, D] — the P positions every row shares (a cached
    prefix, one copy) then the packed ones. Each row is spread back to its padded place, its
    queries seeing the shared positions and its own positions up to theirs (a padding query sees
    one key, and its output is dropped), and the kernel runs as for the unpacked rows: Keel's
    bf16 kernel where `_bf16_training_kernels` serves, else SDPA with that mask. Returns
    [1, N, H, D]. Per real position the same sums as the padded rows; padding costs no GEMM."""
    N = layout.index.numel()
    P = key.shape[2] - N
    B, W = layout.rows, layout.width
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    lib = _bf16_training_kernels(query, key, value)
    if lib is not None:  # autocast's casts for SDPA, made on the packed positions
        query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))

    def spread(x):  # [1, h, N, D] → [B, h, W, D]
        return layout.spread(x[0].transpose(0, 1)).transpose(1, 2)

    q = spread(query)
    k = torch.cat([key[:, :, :P].expand(B, -1, -1, -1), spread(key[:, :, P:])], dim=2)
    v = torch.cat([value[:, :, :P].expand(B, -1, -1, -1), spread(value[:, :, P:])], dim=2)
    if lib is not None:
        out = _NativeAttention.apply(q, k, v, layout.keys_seen(P), scale, lib)  # [B, W, H, D]
    else:  # an additive mask: the CPU flash kernel takes it
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.additive_mask(P, q.dtype), scale=scale,
                                                               enable_gqa=groups > 1).transpose(1, 2)
    return out.reshape(B * W, *out.shape[2:]).index_select(0, layout.index)[None]


def packs_rows(config) -> bool:
    """Whether `_hidden_states_of` may run a model's padded rows packed: every layer plain causal
    attention (no sliding window, no logit softcap), which `_packed_attention` computes."""
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True) is not False
    return (not types or all(t == "full_attention" for t in types)) and not sliding and getattr(config, "attn_logit_softcapping", None) is None


def _bf16_training_kernels(query, key, value):
    """keel.native's library where its bf16 training attention serves these inputs — SDPA would
    run them in bf16 (all bf16, or bf16 autocast on: the rotary output arrives in fp32 there and
    autocast casts it for SDPA), the CPU has AVX512-BF16 and the library was built for it, the head
    dim is a multiple of 32 — else None. KEEL_TRAIN_ATTENTION=0 in the environment keeps SDPA."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    if not (dtypes == {torch.bfloat16} or (autocast and dtypes <= {torch.bfloat16, torch.float32})) or query.shape[-1] % 32:
        return None
    if os.environ.get("KEEL_TRAIN_ATTENTION", "1") == "0":
        return None
    lib = native.ops()
    return lib if "dpbf16" in native.bf16_kernels(lib) else None


def _visible_keys(mask: torch.Tensor | None, causal: bool, B: int, Tq: int, Tk: int) -> torch.Tensor | None:
    """n [B, Tq] int32: query row t of batch row b sees keys 0 .. n[b, t]-1 under this attention
    mask — or None where the mask is not of that form (a hole, a row seeing no key, a float mask,
    one per head), and SDPA runs instead. The masks keel builds (causal, offset by a cached
    prefix, right padding) are; the result is kept on the mask object, which every layer shares."""
    if mask is None:
        t = torch.arange(1, Tq + 1, dtype=torch.int32) if causal else torch.full((Tq,), Tk, dtype=torch.int32)
        return t.expand(B, Tq).contiguous()
    cached = getattr(mask, "_keel_visible", None)
    if cached is not None:
        return cached if cached is not False and cached.shape == (B, Tq) else None
    visible = None
    if mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2:] == (Tq, Tk) and mask.shape[0] in (1, B):
        rows = mask[:, 0].expand(B, Tq, Tk)
        n = rows.sum(-1, dtype=torch.int32)
        if bool((n > 0).all()) and torch.equal(rows, torch.arange(Tk) < n[..., None]):
            visible = n.contiguous()
    mask._keel_visible = visible if visible is not None else False
    return visible


# a growing fp32 buffer per thread, for the training attention and the LM head's log-softmax (each
# uses it within one call): fresh pages on every call cost ~5% of an attention call
_SCRATCH = threading.local()


def _scratch(n: int) -> torch.Tensor:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float32)
    return buf


class _NativeAttention(torch.autograd.Function):
    """keel_train_attention (keel/decode_ops.c): bf16 causal grouped-query attention as
    AVX512-BF16 dot products with fp32 sums, forward and backward. q [B, H, Tq, D], k and v
    [B, KV, Tk, D], `visible` [B, Tq] (`_visible_keys`); returns [B, Tq, H, D], the layout
    transformers' attention functions return. Against float64 its output and gradients stay
    within 1.5× of torch's bf16 SDPA's error (0.5–1.2× measured, tests/test_logprobs.py); it runs
    2× faster than torch's CPU flash kernel, which computes bf16 at fp32 speed without AMX."""

    @staticmethod
    def forward(ctx, query, key, value, visible, scale, lib):
        q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
        B, H, Tq, D = q.shape
        KV, Tk = k.shape[1], k.shape[2]
        threads = torch.get_num_threads()
        out = torch.empty(B, Tq, H, D, dtype=torch.bfloat16)
        keep = any(ctx.needs_input_grad[:3])  # no graph (no_grad, frozen reference): no log-sum-exp kept
        lse = torch.empty(B, H, Tq, dtype=torch.float32) if keep else None
        scratch = _scratch(lib.keel_train_attention_scratch(B, H, KV, Tk, D, threads, 0))
        lib.keel_train_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), visible.data_ptr(), out.data_ptr(),
                                 lse.data_ptr() if keep else None, scratch.data_ptr(), threads, B, H, KV, Tq, Tk, D, scale)
        if keep:
            ctx.save_for_backward(q, k, v, visible, out, lse)
        ctx.scale, ctx.lib = scale, lib
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, visible, out, lse = ctx.saved_tensors
        B, H, Tq, D = q.shape
        KV, Tk = k.shape[1], k.shape[2]
        threads = torch.get_num_threads()
        grad = grad.to(torch.bfloat16).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        scratch = _scratch(ctx.lib.keel_train_attention_scratch(B, H, KV, Tk, D, threads, 1))
        ctx.lib.keel_train_attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), visible.data_ptr(), out.data_ptr(),
                                              grad.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                              scratch.data_ptr(), threads, B, H, KV, Tq, Tk, D, ctx.scale)
        return dq, dk, dv, None, None, None


class _NativeRotary(torch.autograd.Function):
    """keel_rotary (keel/decode_ops.c, the decode step's): transformers' `apply_rotary_pos_emb` for
    one of q, k in one pass where x is fp32 or bf16 and cos, sin are fp32 (fp32 training; bf16
    autocast, where the projections' outputs are bf16 and the rotary runs in fp32 by type
    promotion) — the same roundings as its four ops (x·cos, rotate_half's cat, ·sin, +), bit for
    bit, forward and backward (tests/test_logprobs.py). x [B, H, T, D] (D contiguous: the
    projections' output transposed), cos and sin [B or 1, T, D] → fp32 (in x's layout)."""

    @staticmethod
    def forward(ctx, x, cos, sin, lib):
        out = torch.empty_like(x, dtype=torch.float32)
        _rotary(lib, x, cos, sin, out, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.dtype, ctx.lib = x.dtype, lib
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        g = grad.float()
        if g.stride(-1) != 1:
            g = g.contiguous()
        dx = torch.empty_like(g, dtype=ctx.dtype)
        _rotary(ctx.lib, g, cos, sin, dx, backward=True)
        return dx, None, None, None


def _rotary(lib, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, backward: bool) -> None:
    """keel_rotary from src [B, H, T, D] into dst (each at its own strides), cos and sin fp32."""
    B, H, T, D = src.shape
    lib.keel_rotary(src.data_ptr(), *src.stride()[:3], int(src.dtype == torch.bfloat16), cos.data_ptr(), sin.data_ptr(), 0,
                    cos.stride(0) if cos.shape[0] > 1 else 0, dst.data_ptr(), *dst.stride()[:3], int(dst.dtype == torch.bfloat16),
                    int(backward), B, H, T, D)


# transformers modules whose `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` is Llama's
# (q·cos + rotate_half(q)·sin over the whole head dim), which `_native_rotary` may stand in for
ROTARY_MODULES = ("llama", "mistral", "qwen2", "qwen3")


def _rotary_ready(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `_NativeRotary` takes q, k [B, heads, T, D] with cos, sin [B or 1, T, D] as
    transformers passes them: on the CPU, q and k fp32 or bf16 with D contiguous (a multiple of
    32), cos and sin contiguous fp32 without gradients."""
    if not (q.dim() == k.dim() == 4 and cos.dim() == 3):
        return False
    B, _, T, D = q.shape
    return (all(x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1 for x in (q, k))
            and k.shape[0] == B and k.shape[2:] == q.shape[2:] and D % 32 == 0
            and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.shape[0] in (1, B) and cos.shape[1:] == (T, D)
            and cos.is_contiguous() and sin.is_contiguous() and not (cos.requires_grad or sin.requires_grad))


@contextlib.contextmanager
def _native_rotary(body):
    """Run `body` with `_NativeRotary` in place of its module's `apply_rotary_pos_emb` (a Llama-family
    transformers module, keel.native's library loaded), for the inputs it takes; others, and
    other models, go to transformers' own function. Values and gradients are the same either way,
    so a forward of the same model family in another thread meanwhile (it sees the module's
    function replaced) computes what it would have."""
    layers = getattr(body, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers is not None and len(layers) else None
    module = sys.modules.get(type(attn).__module__) if attn is not None else None
    original = getattr(module, "apply_rotary_pos_emb", None)
    lib = native.ops() if module is not None and module.__name__.rsplit(".", 1)[-1].removeprefix("modeling_") in ROTARY_MODULES else None
    if lib is None or original is None or getattr(original, "_keel_native", False):
        yield
        return

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and _rotary_ready(q, k, cos, sin):
            return _NativeRotary.apply(q, cos, sin, lib), _NativeRotary.apply(k, cos, sin, lib)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb._keel_native = True
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original


@contextlib.contextmanager
def training_attention(body):
    """Run `body` (a transformers decoder) with `_training_sdpa` inside, where it used SDPA, and
    keel.native's rotary (`_native_rotary`)."""
    with cascade.in_place_of_sdpa(body.config, TRAINING_ATTENTION, _training_sdpa), _native_rotary(body):
        yield


PREFIX_SEGMENT = 192  # positions of the shared prefix whose graph `SharedPrefix.backward` holds at once
MIN_SHARED_PREFIX = 32  # below this, encoding the prefix separately saves less than it costs


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Length of the token prefix every row shares (rows are right-padded), at most min length − 1:
    `common_prefix_len` of the rows without their padding."""
    lengths = attention_mask.sum(-1).tolist()
    return common_prefix_len([row[:n] for row, n in zip(input_ids.tolist(), lengths)])


def micro_batches(sequences: list[list[int]], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Split sequence indices into consecutive micro-batches of at most `max_rows` rows whose
    forward encodes at most `max_tokens` token positions (0: no token cap), encoding the fewest
    positions in all (then the fewest micro-batches).

    A micro-batch's cost is what `_hidden_states` encodes: the rows' shared prefix once, then
    every row right-padded to the longest remainder: lcp + rows × (longest − lcp) (lcp counted
    only when it reaches MIN_SHARED_PREFIX). Training activations grow with that count
    (~1.2 MB per position for SmolLM2 under bf16 autocast), so the cap bounds a step's memory
    whatever the sampled lengths (with an update-wide SharedPrefix the prefix is held once for
    the update instead, and rows run packed (`_pack_layout`) encode no padding, so the count is
    an upper bound). A single row over the cap forms its
    own micro-batch. Cutting where the rows stop sharing (GRPO's groups: one prompt, several
    samples) and where lengths jump saves the positions a greedy fill would pad or encode again:
    on the KG task (2 prompts × 4 samples, 2,048-position cap) the greedy fill put a row of the
    second group with the first four and encoded 2,137 positions besides the system block; cut
    at the groups, 1,624.
    Worked example: lengths 100, 100, 300 with no shared prefix, max_tokens 300 → [[0, 1], [2]]
    (200 + 300 positions; [[0], [1], [2]] also 500 but one micro-batch more).
    """
    n = len(sequences)
    # the lcp of rows i..j is the least lcp of neighbours in it (each at most the shorter's length − 1)
    pair = [common_prefix_len([sequences[i], sequences[i + 1]]) for i in range(n - 1)]
    best: list[tuple[int, int] | None] = [(0, 0)] + [None] * n  # best[j]: (positions, micro-batches) of rows [0, j)
    cut = [0] * (n + 1)
    for i in range(n):
        if best[i] is None:
            continue
        lcp, longest = len(sequences[i]) - 1, len(sequences[i])
        for j in range(i + 1, min(n, i + max_rows) + 1):  # the micro-batch of rows [i, j)
            if j > i + 1:
                longest, lcp = max(longest, len(sequences[j - 1])), min(lcp, pair[j - 2])
            cost = _positions(lcp, j - i, longest)
            if j > i + 1 and 0 < max_tokens < cost:
                break  # the cost only grows with more rows
            total = (best[i][0] + cost, best[i][1] + 1)
            if best[j] is None or total <= best[j]:  # ties: the later cut, filling the first micro-batches
                best[j], cut[j] = total, i
    parts: list[list[int]] = []
    j = n
    while j > 0:
        parts.append(list(range(cut[j], j)))
        j = cut[j]
    return parts[::-1]


def encoded_positions(sequences: list[list[int]]) -> int:
    """The token positions one forward of these rows encodes, as `micro_batches` counts a
    micro-batch: the rows' common prefix once (where it reaches MIN_SHARED_PREFIX), then every
    row right-padded to the longest remainder; a single row, its length.
    Worked example: rows of 40 shared + 7 and 40 shared + 12 tokens → 40 + 2 × 12 = 64."""
    longest = max(len(q) for q in sequences)
    if len(sequences) == 1:
        return longest
    return _positions(common_prefix_len(sequences), len(sequences), longest)


def _positions(lcp: int, rows: int, longest: int) -> int:
    """Positions `_hidden_states` encodes for `rows` rows sharing `lcp` tokens, the longest
    `longest`: the shared tokens once (where they reach MIN_SHARED_PREFIX), then each row padded
    to the longest remainder."""
    shared = lcp if lcp >= MIN_SHARED_PREFIX else 0
    return shared + rows * (longest - shared)


def common_prefix_len(sequences: list[list[int]]) -> int:
    """Tokens every sequence starts with, at most the shortest length − 1 (0 for < 2 sequences)."""
    if len(sequences) < 2:
        return 0
    first = sequences[0]
    n = min(len(q) for q in sequences) - 1
    for q in sequences[1:]:
        k = 0
        while k < n and q[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


class SharedPrefix:
    """The shared prefix of a whole update (every micro-batch's rows start with it), encoded once.

    Within one micro-batch `_hidden_states` already encodes the rows' common prefix once; when
    the token cap splits an update into several micro-batches, each would encode it again (the
    560-token system block of the KG task is ~25% of a 2,048-position micro-batch). Here the
    prefix is encoded once without gradients; micro-batches attend to leaf copies of its keys,
    values and hidden states, whose gradients accumulate over the micro-batches, and
    `backward()` then encodes the prefix again with gradients, `segment` positions at a time from
    the last segment back (each segment attends to the stored keys and values before it as
    leaves, whose gradients join the earlier segments'), so only one segment's graph is alive
    at a time. The weight gradients are the sum of what each micro-batch's own prefix would
    have given (tests/test_logprobs.py). `keep_graph`: the first encoding is made with gradients
    and its graph held until `backward()`, which then only back-propagates it — one forward of
    the prefix less, and one backward pass over all its positions instead of one per segment
    (`update_prefix` asks for it where the token cap allows it). Not used with gradient
    checkpointing (HF drops the cache inside checkpointed layers).
    """

    def __init__(self, model, ids: list[int], segment: int = 0, keep_graph: bool = False):
        self.segment = segment or PREFIX_SEGMENT
        self._body = getattr(model, model.base_model_prefix)
        device = next(model.parameters()).device
        self.ids = torch.tensor(ids, device=device)
        self._autocast = (device.type, torch.get_autocast_dtype(device.type), torch.is_autocast_enabled(device.type))
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in self._body.parameters())
        self._sources: list[torch.Tensor] = []  # the encoding with its graph, where it is kept (keep_graph)
        if trains and keep_graph:
            self._sources = self._encode()
            self._leaves = [t.detach().requires_grad_() for t in self._sources]
            return
        with torch.no_grad():  # nothing of the prefix's graph is kept: `backward` encodes it again
            self._leaves = [t.requires_grad_(trains) for t in self._encode()]

    def __len__(self) -> int:
        return self.ids.numel()

    def matches(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
        L = len(self)
        return (input_ids.shape[1] > L and bool((attention_mask.sum(-1) > L).all())
                and bool((input_ids[:, :L] == self.ids[None]).all()))

    def states(self, batch: int):
        """(hidden [B, L, H], a DynamicCache holding the prefix for `batch` rows)."""
        from transformers import DynamicCache

        hidden, kv = self._leaves[0], self._leaves[1:]
        cache = DynamicCache()
        for layer in range(len(kv) // 2):
            k, v = kv[2 * layer], kv[2 * layer + 1]
            cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), layer)
        return hidden.expand(batch, -1, -1), cache

    def _encode(self, start: int = 0, end: int | None = None, past: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """[last hidden state, keys and values of every layer] of prefix positions [start, end)
        (one row), attending to `past` (keys and values of every layer for [0, start))."""
        from transformers import DynamicCache

        end = len(self) if end is None else end
        cache = DynamicCache()
        for layer in range(len(past or []) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        positions = torch.arange(start, end, device=self.ids.device)[None]
        with training_attention(self._body):
            out = self._body(input_ids=self.ids[None, start:end], position_ids=positions, past_key_values=cache, use_cache=True)
        return [out.last_hidden_state] + [t[:, :, start:] for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]

    def backward(self) -> None:
        """Back-propagate the gradients the micro-batches left on the leaves through the prefix:
        through the kept graph (keep_graph), else the prefix is encoded again, with gradients and
        in the precision it was first encoded in (the same values), and its graph is freed at
        once. Holding the first encoding's graph over the whole update costs ~1.1 MB per prefix
        position (~650 MB for the KG task's system block); encoding it twice costs one forward
        of the prefix, and encoding it in segments (the class docstring) keeps one segment's
        graph alive at a time."""
        leaves, self._leaves = self._leaves, []
        sources, self._sources = self._sources, []
        grads = [leaf.grad for leaf in leaves]
        if all(g is None for g in grads):
            return
        device, dtype, autocast = self._autocast
        if sources:  # kept from the first encoding (keep_graph): back-propagated as it is
            pairs = [(src, g) for src, g in zip(sources, grads) if g is not None]
            with torch.autocast(device, enabled=False):
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
            return
        L = len(self)
        for start in reversed(range(0, L, self.segment)):
            end = min(start + self.segment, L)
            past = [t[:, :, :start].detach().requires_grad_() for t in leaves[1:]] if start else None
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=autocast):
                sources = self._encode(start, end, past)
            pairs = [(src, g[:, start:end] if i == 0 else g[:, :, start:end])
                     for i, (src, g) in enumerate(zip(sources, grads)) if g is not None]
            with torch.autocast(device, enabled=False):
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
            for i, t in enumerate(past or [], start=1):  # what the segment sent back to the keys and values before it
                if t.grad is not None:
                    if grads[i] is None:
                        grads[i] = torch.zeros_like(leaves[i])
                    grads[i][:, :, :start] += t.grad  # the leaves are this method's alone now: in place
            del sources, pairs, past


_KEPT_PREFIXES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # network → (key, SharedPrefix)


def update_prefix(model, sequences: list[list[int]], parts: list[list[int]], reuse: bool = False, max_tokens: int = 0,
                  keep_graph: bool = True) -> SharedPrefix | None:
    """The prefix all of an update's sequences share, encoded once for all its micro-batches
    `parts`, when there are several and it is long enough to matter (None otherwise, and with
    gradient checkpointing, where `_hidden_states` could not use it). Call under the update's
    autocast.

    `max_tokens`: the update's cap on the positions one forward encodes (`micro_batches`; 0: no
    cap). With `keep_graph` (`model.recompute_shared_prefix` false), where every micro-batch's
    counted positions (`encoded_positions`, the prefix included) are within it, the prefix's
    graph is kept over the micro-batches (SharedPrefix's `keep_graph`): what is alive while a
    micro-batch runs is then what the cap already counted for it. Otherwise (or a micro-batch
    over the cap: a single row longer than it) no graph is kept and `backward()` encodes the
    prefix again in segments of PREFIX_SEGMENT positions.

    `reuse` (a network called without gradients: the KL reference): the encoding is kept, and
    the next call gets it back while the prefix tokens, the autocast dtype and the network's
    weights (every parameter's storage and in-place version) are the same — every update of a
    run starts with the same system block, and a frozen reference never changes (SmolLM2 on the
    KG task: ~0.3 s an update; the same values, tests/test_logprobs.py)."""
    body = getattr(model, model.base_model_prefix)
    if len(parts) < 2 or getattr(body, "gradient_checkpointing", False):
        return None
    L = common_prefix_len(sequences)
    if L < MIN_SHARED_PREFIX:
        return None
    ids = sequences[0][:L]
    if not reuse:
        keep = keep_graph and all(max_tokens <= 0 or encoded_positions([sequences[i] for i in part]) <= max_tokens for part in parts)
        return SharedPrefix(model, ids, keep_graph=keep)
    if torch.is_grad_enabled():
        raise ValueError("update_prefix(reuse=True) is for a network called without gradients (under torch.no_grad)")
    device = next(model.parameters()).device.type
    key = (tuple(ids), torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device),
           tuple((p.data_ptr(), p._version) for p in model.parameters()))
    kept = _KEPT_PREFIXES.get(model)
    if kept is None or kept[0] != key:
        kept = _KEPT_PREFIXES[model] = (key, SharedPrefix(model, ids))
    return kept[1]


def _hidden_states(body, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: SharedPrefix | None = None) -> torch.Tensor:
    """Last hidden states [B, T, H]. Rows of a batch usually share their prompt's system block
    (~600 of ~900 tokens on the KG task): it is encoded once and its KV cache repeated over the
    batch, gradients flowing through it, which cuts a training step's tokens about 2×. With a
    `prefix` encoded for the whole update (SharedPrefix) that the rows start with, it is reused
    instead, and what the rows share beyond it (a GRPO group's question) is encoded once on top
    of it. Equal to one plain forward (tests/test_logprobs.py checks values and gradients)."""
    if body.training and getattr(body, "gradient_checkpointing", False):  # recomputed in backward, outside this call
        return _hidden_states_of(body, input_ids, attention_mask, prefix)
    with training_attention(body):
        return _hidden_states_of(body, input_ids, attention_mask, prefix)


def _hidden_states_of(body, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: SharedPrefix | None) -> torch.Tensor:
    B, T = input_ids.shape
    # HF drops the cache inside checkpointed layers while training, so with gradient
    # checkpointing on, the prefix cannot be shared: one plain forward instead
    checkpointing = body.training and getattr(body, "gradient_checkpointing", False)
    # L: positions already encoded (the update's SharedPrefix, when the rows start with it);
    # shared: what the rows share, encoded once on top of it (a GRPO group's question)
    L = len(prefix) if prefix is not None and not checkpointing and prefix.matches(input_ids, attention_mask) else 0
    shared = max(L, shared_prefix_len(input_ids, attention_mask))
    if not L and (shared < MIN_SHARED_PREFIX or checkpointing):
        layout = None if checkpointing else _pack_layout(body, input_ids, attention_mask, 0)
        if layout is None:
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            return body(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).last_hidden_state
        return _packed_forward(body, layout, input_ids, 0)
    layout = _pack_layout(body, input_ids, attention_mask, shared)
    rows = B if layout is None else 1  # packed rows attend to one copy of what they share
    if shared == L:
        pre_hidden, cache = prefix.states(rows)
    else:
        hidden, cache = prefix.states(1) if L else (None, None)
        more = body(input_ids=input_ids[:1, L:shared], position_ids=torch.arange(L, shared, device=input_ids.device)[None],
                    past_key_values=cache, use_cache=True)
        cache = more.past_key_values
        if rows > 1:
            cache.batch_repeat_interleave(B)
        pre_hidden = more.last_hidden_state if hidden is None else torch.cat([hidden, more.last_hidden_state], dim=1)
        L = shared
    pre_hidden = pre_hidden.expand(B, L, -1)
    if layout is None:
        positions = torch.arange(L, T, device=input_ids.device).expand(B, T - L)  # right padding: index = position
        rest = body(input_ids=input_ids[:, L:], attention_mask=attention_mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return torch.cat([pre_hidden, rest.last_hidden_state], dim=1)
    return torch.cat([pre_hidden, _packed_forward(body, layout, input_ids[:, L:], L, cache)], dim=1)


def _packed_forward(body, layout: _Packed, ids: torch.Tensor, start: int, cache=None) -> torch.Tensor:
    """Last hidden states [B, W, H] of right-padded rows ids [B, W] at positions start.., run as
    one row of their real positions (`layout`) after `cache` (one copy of what they share, or
    None), zero at padding."""
    with _packing(layout):
        out = body(input_ids=ids.flatten()[layout.index][None], position_ids=(start + layout.index % ids.shape[1])[None],
                   past_key_values=cache, use_cache=cache is not None)
    return layout.spread(out.last_hidden_state[0])


def _pack_layout(body, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: int) -> _Packed | None:
    """How `_hidden_states_of` runs rows [B, T] beyond their `shared` positions packed (padding
    dropped, `_packed_attention`) — or None where it runs them as they are: a single row, rows
    with no padding, rows not right-padded, not on the CPU, not under `training_attention` (only
    `_training_sdpa` takes packed rows; elsewhere transformers' attention runs), a model whose
    attention is not plain causal (`packs_rows`), or KEEL_PACK_ROWS=0 in the environment. On the
    KG task a GRPO group's four samples are padded to the longest (10% of the bench batch's
    micro-batch positions); packed, the projections, MLP and norms run on real positions only."""
    B, T = input_ids.shape
    if (B < 2 or input_ids.device.type != "cpu" or os.environ.get("KEEL_PACK_ROWS", "1") == "0" or not packs_rows(body.config)
            or getattr(body.config, "_attn_implementation", None) != TRAINING_ATTENTION):  # only `_training_sdpa` takes packed rows
        return None
    keep = attention_mask[:, shared:].bool()
    lengths = keep.sum(-1)
    if bool((lengths == T - shared).all()) or not torch.equal(keep, torch.arange(T - shared, device=keep.device) < lengths[:, None]):
        return None
    return _Packed(keep)


def _head_buffers(rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Three fp32 [rows, vocab] work buffers for `_HeadLogprobs`: on CPU from `_scratch` (grown to
    the largest chunk: 150 MB at 256 rows of 49,152), since a fresh 50 MB tensor is memory the OS
    maps and zeroes page by page on first touch, which made a chunk's passes (copy, log-softmax,
    exp, products) ~4× slower than the same passes over memory already touched (80–95 vs 21–24 ms
    for 256 rows, LOG.md, thirty-eighth session). Elsewhere (CUDA's caching allocator reuses
    memory itself) fresh ones."""
    if device.type != "cpu":
        return tuple(torch.empty(rows, vocab, device=device) for _ in range(3))
    n = rows * vocab
    return _scratch(3 * n)[: 3 * n].view(3, rows, vocab).unbind(0)


def _log_softmax_into(logits: torch.Tensor, temperature: float, x: torch.Tensor, logp: torch.Tensor) -> None:
    """logp = log_softmax(logits.float() / temperature) with the ops (and so the bits) of the
    out-of-place `logits.float()`, `/ temperature`, `torch.log_softmax`, into x and logp."""
    x.copy_(logits)
    if temperature != 1.0:  # x / 1.0 == x: skip a pass over [chunk, vocab]
        x.div_(temperature)
    torch._log_softmax(x, 1, False, out=logp)


def _chunk_picked(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of `targets` [n], entropies [n], or an empty tensor without `with_entropy`) of one
    chunk of logits [n, V], as log_softmax(logits.float() / temperature) and a gather give them,
    over `_head_buffers`."""
    x, logp, _ = _head_buffers(logits.shape[0], logits.shape[1], logits.device)
    _log_softmax_into(logits, temperature, x, logp)
    picked = logp.gather(1, targets[:, None])[:, 0]
    entropy = -torch.mul(torch.exp(logp, out=x), logp, out=x).sum(-1) if with_entropy else picked.new_zeros(0)
    return picked, entropy


def _chunk_logit_grad(logits: torch.Tensor, targets: torch.Tensor, grad_picked: torch.Tensor, temperature: float) -> torch.Tensor:
    """The gradient [n, V] (fp32, in a `_head_buffers` buffer: valid until the next call) of the
    picked log-probs of `_chunk_picked` with respect to the chunk's logits, the log-softmax
    recomputed from them."""
    x, logp, grad = _head_buffers(logits.shape[0], logits.shape[1], logits.device)
    _log_softmax_into(logits, temperature, x, logp)
    x.zero_().scatter_add_(1, targets[:, None], grad_picked[:, None])  # gather's backward
    torch._log_softmax_backward_data(x, logp, 1, torch.float32, out=grad)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class _HeadLogprobs(torch.autograd.Function):
    """(log-probs of `targets`, entropies) of a chunk of the LM head's logits [n, V], as
    log_softmax(logits.float() / temperature) and a gather would give them, forward and backward
    bit for bit (tests/test_logprobs.py), over `_head_buffers`: the fp32 copy and the log-softmax are
    not kept for backward but recomputed there from the logits (which are), as checkpointing the
    chunk did, into the same buffers. The entropy (no gradient) only with `with_entropy`."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool):
        picked, entropy = _chunk_picked(logits, targets, temperature, with_entropy)
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        logits, targets = ctx.saved_tensors
        return _chunk_logit_grad(logits, targets, grad_picked, ctx.temperature).to(logits.dtype, copy=True), None, None, None


def _chunk_logprobs(head, h: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _HeadLogprobs.apply(head(h), targets, temperature, with_entropy)


# The head's weight in the precision autocast computes it in, cast once and kept while an update's
# micro-batches run (`training_passes` releases them), as autocast keeps its own casts of trainable
# weights: id(weight) → (weakref to it, its version, dtype, the cast).
_CAST_WEIGHTS: dict[int, tuple] = {}
_HEAD_GRAD_BLOCK = 1 << 20  # elements of the weight's gradient converted and added at once (4 MB in fp32)


def release_update_buffers() -> None:
    """Drop what `_HeadProduct` keeps over an update's micro-batches, the head weights cast for it
    and the logits buffer (`training_passes` calls this when it ends), so rollouts and evaluations
    between updates do not hold them."""
    _CAST_WEIGHTS.clear()
    if getattr(_SCRATCH, "logits", None) is not None and _SCRATCH.logits[1]() is None:
        _SCRATCH.logits = None


@contextlib.contextmanager
def training_passes(model, autocast: bool):
    """The region an update's forwards and backward passes run in (keel.train.grpo_update,
    keel.sft.supervision_backward): bf16 autocast when `autocast`, held open over all micro-batches
    so the weights are cast once (`autocast_context`), and sparse embedding gradients
    (`sparse_embedding_grads`). Backward passes inside still run under `no_autocast`. The LM
    head's weight cast for autocast and its logits buffer (`_HeadProduct`) are kept
    until it ends, as autocast keeps its own casts."""
    try:
        with autocast_context(model, autocast), sparse_embedding_grads(model):
            yield
    finally:
        release_update_buffers()


def _cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if weight.dtype == dtype:
        return weight.detach()
    kept = _CAST_WEIGHTS.get(id(weight))
    if kept is not None and kept[0]() is weight and kept[1] == weight._version and kept[2] == dtype:
        return kept[3]
    cast = weight.detach().to(dtype)
    _CAST_WEIGHTS[id(weight)] = (weakref.ref(weight), weight._version, dtype, cast)
    return cast


def _accumulate_weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """weight.grad += grad_outᵀ · x ([V, N] · [N, H]) as autograd's accumulation would add it, in
    blocks of the weight's rows: each block's product in the inputs' precision, then converted to
    the gradient's dtype and added. No [V, H] temporary is made: autograd's way (a product per
    chunk, their bf16 sum, its fp32 copy, that plus the tied embedding's gradient) allocated ~4
    of them per micro-batch, 57–113 MB each for SmolLM2, which glibc's heap served from fresh
    pages each time (a freed one is split by small allocations before the next asks): 0.25–0.3 s
    of page faults per micro-batch of the bench's 8 × 4 update (LOG.md, forty-fourth session).
    Being no autograd accumulation, it runs no hook registered on one (none in Keel; the
    data-parallel all-reduce reads `.grad` after backward)."""
    V, H = weight.shape
    grad = weight.grad
    if grad is not None and grad.is_sparse:  # only the embedding's rows so far (a tied weight)
        grad = weight.grad = grad.to_dense()
    fresh = grad is None
    if fresh:
        grad = torch.empty_like(weight, memory_format=torch.contiguous_format)
    rows = max(1, min(V, _HEAD_GRAD_BLOCK // max(H, 1)))
    same = grad_out.dtype == grad.dtype
    part = None if same else torch.empty(rows, H, dtype=grad_out.dtype, device=x.device)
    wide = None if same else torch.empty(rows, H, dtype=grad.dtype, device=x.device)
    for s in range(0, V, rows):
        e = min(V, s + rows)
        if same:
            if fresh:
                torch.mm(grad_out[:, s:e].t(), x, out=grad[s:e])
            else:
                grad[s:e].addmm_(grad_out[:, s:e].t(), x)
            continue
        torch.mm(grad_out[:, s:e].t(), x, out=part[: e - s])
        if fresh:
            grad[s:e].copy_(part[: e - s])
        else:
            wide[: e - s].copy_(part[: e - s])
            grad[s:e].add_(wide[: e - s])
    if fresh:
        weight.grad = grad


class _Lease:
    """Held by the graph that uses `_logits_buffer`'s buffer (its ctx) until that graph's backward
    has run or the graph is freed."""


def _logits_buffer(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, _Lease]:
    """A [rows, vocab] tensor for `_HeadProduct`'s logits and a lease on it. On CPU, while no other
    graph holds it, a per-thread buffer grown to the largest micro-batch, since a fresh [N, V]
    tensor (57 MB at 578 rows of 49,152 in bf16) came from fresh pages each micro-batch (245 ms
    for a product that takes ~95 ms into touched memory; LOG.md, forty-fourth session). The
    update's micro-batches each run backward before the next forward, so one buffer serves them
    all; a second forward before the first's backward gets a fresh tensor."""
    lease = _Lease()
    n = rows * vocab
    if device.type != "cpu":
        return torch.empty(rows, vocab, dtype=dtype, device=device), lease
    held = getattr(_SCRATCH, "logits", None)
    if held is not None and held[1]() is None and held[0].dtype == dtype and held[0].numel() >= n:
        buf = held[0]
    elif held is None or held[1]() is None:
        buf = torch.empty(n, dtype=dtype)
    else:
        return torch.empty(rows, vocab, dtype=dtype), lease
    _SCRATCH.logits = (buf, weakref.ref(lease))
    return buf[:n].view(rows, vocab), lease


class _HeadProduct(torch.autograd.Function):
    """(log-probs of `targets`, entropies) of the rows h [N, H] under a bias-free linear LM head
    (weight [V, H]), with `_HeadLogprobs`'s chunked log-softmax, for a pass that takes gradients
    (`token_logprobs` calls it for a bias-free `nn.Linear` head).

    The head's product runs once over all N rows, in `compute`'s dtype (the weight cast for
    autocast, or the weight itself), its logits [N, V] kept for backward as the chunks' were. In
    backward each chunk's logit gradient is written over its logits (they are not needed after;
    so a second backward through the same graph is refused), h's gradient is one product, and
    the weight's is added to `weight.grad` by `_accumulate_weight_grad` rather than returned to
    autograd: one product over the micro-batch's N rows, summed in fp32 into the gradient,
    instead of a bf16 product per 256-row chunk, their bf16 sum, its fp32 copy. Numerically that
    is autograd's gradient with fewer roundings (tests/test_logprobs.py compares the two)."""

    @staticmethod
    def forward(ctx, h, weight, compute, targets, temperature: float, with_entropy: bool, chunk: int):
        x = h.detach().to(compute.dtype)
        logits, ctx.lease = _logits_buffer(x.shape[0], compute.shape[0], compute.dtype, x.device)
        torch.mm(x, compute.t(), out=logits)  # [N, V]
        parts = [_chunk_picked(logits[s : s + chunk], targets[s : s + chunk], temperature, with_entropy) for s in range(0, x.shape[0], chunk)]
        picked = torch.cat([p for p, _ in parts]) if parts else x.new_zeros(0, dtype=torch.float32)
        entropy = torch.cat([e for _, e in parts]) if parts else picked.new_zeros(0)
        ctx.save_for_backward(x, logits, targets, compute)
        ctx.weight, ctx.h_dtype, ctx.temperature, ctx.chunk = weight, h.dtype, temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        if ctx.lease is None:  # released by an earlier backward, which overwrote the logits
            raise RuntimeError("keel.logprobs._HeadProduct: a second backward through the same LM head (its logits were overwritten by the first)")
        x, logits, targets, compute = ctx.saved_tensors
        c = ctx.chunk
        for s in range(0, x.shape[0], c):  # each chunk's logit gradient, in the logits' dtype, where its logits were
            logits[s : s + c].copy_(_chunk_logit_grad(logits[s : s + c], targets[s : s + c], grad_picked[s : s + c], ctx.temperature))
        grad_h = torch.mm(logits, compute).to(ctx.h_dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            _accumulate_weight_grad(ctx.weight, logits, x)
        ctx.lease = None  # the logits buffer is free for the next micro-batch
        return grad_h, None, None, None, None, None, None


def _head_without_grad(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                       with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_chunk_picked` over chunks of x [N, H] · weightᵀ, no gradients, each chunk's logits written
    into one `_logits_buffer` (a fresh [chunk, V] tensor each chunk came from fresh pages: 78 ms
    per 256-row product of the reference's against ~45 into touched memory; LOG.md, forty-fourth
    session). The same products and log-softmax as `head(h)` chunk by chunk."""
    n = min(chunk, x.shape[0])
    buf, lease = _logits_buffer(n, weight.shape[0], weight.dtype, x.device)
    out, ents = [], []
    for s in range(0, x.shape[0], chunk):
        logits = buf[: min(chunk, x.shape[0] - s)]
        torch.mm(x[s : s + chunk], weight.t(), out=logits)
        lp, ent = _chunk_picked(logits, targets[s : s + chunk], temperature, with_entropy)
        out.append(lp)
        ents.append(ent)
    del lease
    logp = torch.cat(out) if out else x.new_zeros(0, dtype=torch.float32)
    return logp, (torch.cat(ents) if ents else logp.new_zeros(0)) if with_entropy else None


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 256,
    with_entropy: bool = False,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the target tokens, in row-major order of `target_mask`.

    input_ids, attention_mask, target_mask: [B, T] → logp [N] (N = target_mask.sum()), and
    entropy [N] of the full next-token distribution (no grad) when `with_entropy`.
    Logits are divided by `temperature`, matching how the rollout sampled. `prefix`: a
    SharedPrefix of the whole update, used when the rows start with it (call its backward()
    after the last micro-batch's).
    """
    body = getattr(model, model.base_model_prefix)
    hidden = _hidden_states(body, input_ids, attention_mask, prefix)
    prev = torch.zeros_like(target_mask)
    prev[:, :-1] = target_mask[:, 1:]  # hidden state at t-1 predicts token t
    h = hidden[prev]  # [N, H]
    targets = input_ids[target_mask]  # [N]
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.bias is None:  # (other heads: their own forward, chunk by chunk, below)
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) and head.weight.dtype == torch.float32 else head.weight.dtype
        if not torch.is_grad_enabled():  # the reference's pass: each chunk's logits into one reused buffer
            return _head_without_grad(h.to(dtype), head.weight.to(dtype), targets, temperature, chunk, with_entropy)
        if h.requires_grad or head.weight.requires_grad:
            logp, ent = _HeadProduct.apply(h, head.weight, _cast_weight(head.weight, dtype), targets, temperature, with_entropy, chunk)
            return logp, ent.detach() if with_entropy else None
    out, ents = [], []
    # With gradients, each chunk's log-softmax is recomputed in backward from its logits, kept in
    # the head's output dtype (bf16 under autocast: 0.1 MB per token for V = 49,152): autograd
    # would otherwise hold an fp32 copy and the log-softmax too (~0.4 MB per token, more than the
    # 30 decoder layers' activations) until backward (`_HeadLogprobs`). Recomputing the head's
    # product as well would cost one more [N, H] × [H, V] product.
    for s in range(0, h.shape[0], chunk):
        lp, ent = _chunk_logprobs(head, h[s : s + chunk], targets[s : s + chunk], temperature, with_entropy)
        out.append(lp)
        ents.append(ent)
    logp = torch.cat(out) if out else hidden.new_zeros(0)
    ent = (torch.cat(ents) if ents else hidden.new_zeros(0)).detach() if with_entropy else None
    return logp, ent
