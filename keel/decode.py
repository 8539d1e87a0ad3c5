"""A lean decode step for Llama-family models: one new token per row, on pre-laid-out weights.

transformers' forward spends most of a CPU decode step outside its matrix multiplies: at batch
16 in bf16, SmolLM2's 211 linear layers take ~17–25 ms per step, the whole forward ~70–80 ms
(`bench/sampler_vs_generate.py` prints both). The rest is per-layer module dispatch, mask and
rotary construction for every call, dtype round trips in RMSNorm, and seven GEMMs per layer
where four do the same work. `LeanDecoder.step` computes the same function with
- q, k and v projections as one GEMM, gate and up as one (weights concatenated once per rollout);
- weights laid out once per rollout in oneDNN's blocked format (`laid_out`; bf16 where oneDNN has
  bf16 kernels, fp32 for a batch of 4 rows or more), not on every call — or, in bf16 on a CPU
  with AVX512-BF16, in pairs for keel/decode_ops.c's `keel_linear_pairs`, which gives oneDNN's
  products bit for bit reading each weight as one stream (`_Pairs`);
- rotary cos/sin computed once per step for all layers, from the rows' positions;
- keys and values appended in place to the rollout's growing cache (`cache.layers[i].update`;
  with the native kernels, written by one kernel call straight from the q/k/v GEMM's output into
  the cache's buffers, `_GrowingLayer.columns`);
- in bf16 where every product is `_Pairs` and the kernels serve the model, the whole layer loop
  of a step in one C call (`_FusedLayers`, keel_decode_layers: the same kernels in the same
  order, so the same bits, without ~55 µs of Python and ctypes a layer between them);
- everything between the GEMMs in one of two implementations with the same interface:
  `_NativeOps`, where keel.native could build its C kernels (keel/decode_ops.c) and the model's
  shapes fit them: the residual add with the next RMSNorm, rotary on q and k, SwiGLU and the whole
  attention over [shared prefix ‖ the row's own keys] (scores, masked softmax, weighted sum in
  fp32) as one call each — in bf16 on a CPU with AMX or AVX512-BF16 (`native.bf16_kernels`), the
  shared prefix's part of the attention as two bf16 products with fp32 sums (AMX: tile matrix
  products over all rows at once); else `_TorchOps`: RMSNorm as
  transformers computes it, rotary on q and k in one set of element-wise ops, SwiGLU, and
  keel.cascade's split attention (or one SDPA call without a shared prefix), masks prepared once
  per step for all layers.
  On an AMX Xeon (LOG.md, twenty-sixth session) the kernels took bench/sampler_vs_generate.py's
  decode step (batch 16, sampling included) from 42.4 to 33.4 ms in bf16 and from 79.1 to 69.9
  ms in fp32; the AMX attention, prefetching and threaded element-wise kernels (twenty-seventh
  session) to 25.8–29.0 and 63.2–66.0 ms.

`LeanDecoder.block` runs the same layer loop over W new tokens per row (keel.rollout's
tool-response blocks and the prompts' remainders after the shared prefix): the GEMMs and
element-wise kernels over the block's real tokens only (ragged blocks are 27–38% padding), and
keel.cascade's split attention with the block's causal mask over the full [B, W] layout, hidden
columns zero. On a main-job-shaped rollout (32 rows, blocks of ~39 tokens, bf16) a block took
0.60–0.69 s against 0.64–1.00 s through transformers' forward (LOG.md, twenty-ninth session);
skipping the padding took a rollout's blocks 1.30–1.50 → 1.24–1.38 s, and the sampler bench's
fp32 prefill block 1.10–1.24 → 0.87–0.90 s (thirty-first session). Only the shared
prefix's encoding (one row) still runs transformers' forward. `tests/test_decode.py` checks the torch
ops' logits against transformers' forward on the same cache (fp32, with and without a shared
prefix: the same episodes token for token); `tests/test_native.py` checks each kernel against the
torch ops (bit-exact where the roundings are the same, within one rounding of the dtype where
summation order or exp differ) and rollouts on the kernels against rollouts on torch ops.
Models it does not cover (biases, other rotary types, sliding windows, non-Llama layouts) get
None from `LeanDecoder.build` and keep transformers' forward.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from keel import cascade, native


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class _Packed:
    """x ↦ x @ weight.T with the weight [out, in] laid out once in oneDNN's blocked format for its
    matrix-multiply kernels. bf16: `x @ weight.T` on a plain tensor lays the weight out again on
    every call; at decode shapes (batch 16) the packed GEMM takes half the time (SmolLM2's q/k/v
    block: 37 vs 79 µs on an AMX Xeon) and gives the same values bit for bit
    (tests/test_decode.py). fp32: a plain product is MKL's sgemm, which at 4-32 rows is slower
    than oneDNN's kernels on the packed weight (batch 16 on the AMX Xeon: gate/up 481 → 312 µs,
    down 293 → 175, the LM head 9.7 → 6.2 ms; LOG.md, thirty-first session) and faster at 1-2
    rows (batch 1: gate/up 137 vs 182 µs): fp32 weights are laid out for a decode batch of
    `FP32_PACKED_MIN_ROWS` rows or more (`laid_out`'s `rows`); the two kernels sum in different
    orders (values within ~1e-6 of each other). Called directly: `x @ packed` through
    `__rmatmul__` cost 18 µs a call more (torch's operator tries the tensor product first)."""

    __slots__ = ("packed",)

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


FP32_PACKED_MIN_ROWS = 4  # decode batches of fewer rows keep fp32 weights plain: MKL's sgemm (see _Packed)


@functools.cache
def _onednn_linear() -> bool:
    """Whether torch has oneDNN and the ops that lay weights out for it."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def _onednn_bf16() -> bool:
    """Whether this process's oneDNN also has bf16 kernels."""
    return _onednn_linear() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packs(weight: torch.Tensor, rows: int = FP32_PACKED_MIN_ROWS) -> bool:
    """Whether `_Packed` serves this weight for products of about `rows` rows: a CPU weight in
    bf16 where oneDNN has bf16 kernels, or in fp32 from `FP32_PACKED_MIN_ROWS` rows."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return _onednn_bf16()
    return weight.dtype == torch.float32 and rows >= FP32_PACKED_MIN_ROWS and _onednn_linear()


class _Pairs:
    """x ↦ x @ weight.T for a bf16 weight [out, in] through keel_linear_pairs (AVX512-BF16 dot
    products, keel/decode_ops.c), the weight laid out once as [out/32][in/2][32] pairs: each tile of
    32 output columns is one stream, read at the memory's speed at decode shapes. Its outputs are
    `_Packed`'s bit for bit — the same VDPBF16PS sums in oneDNN's blocks of inputs, whose size
    `_pair_blocks` finds for the weight's shape (oneDNN's differ for one row and for more: 512 and
    1,024 for SmolLM2's 1,536-input down projection on a Zen 4 EPYC), else the weight stays with
    `_Packed` — at 0.5–0.8× its time: SmolLM2-135M's 211 products at 8 rows 9.3–9.9 vs 14.7–19.7
    ms on that EPYC, 22–24 vs 29–32 ms at 32 rows, and no slower up to 640 rows (LOG.md,
    thirty-eighth session). x: bf16 [n, in]."""

    __slots__ = ("lib", "packed", "out", "inp", "blocks")

    def __init__(self, lib, weight: torch.Tensor, blocks: tuple[int, int] = (0, 0)):
        self.lib, self.blocks = lib, blocks  # the input blocks for one row, for more rows
        self.out, self.inp = weight.shape
        self.packed = torch.empty(self.out * self.inp // 2, dtype=torch.int32)
        lib.keel_pack_pairs(weight.contiguous().data_ptr(), self.packed.data_ptr(), self.out, self.inp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows = x.shape[0]
        y = x.new_empty(rows, self.out)
        self.lib.keel_linear_pairs(x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), rows, self.out, self.inp, self.blocks[rows > 1])
        return y


PAIR_BLOCKS = (512, 1024, 256, 768, 2048)  # oneDNN's input blocks tried, in order
_blocks: dict[tuple[int, int, int], tuple[int, int] | None] = {}  # (out, in, threads) → `_pair_blocks`' answer


def _boundary_probe(out: int, inp: int, first: int) -> torch.Tensor:
    """A bf16 weight [out, inp] that shows where a product's sum starts a new block: column c holds
    2^12 at input 2i (i = first + c, cycling through 0 .. inp/2 - 3), 2^-12 at inputs 2i+2 and
    2i+3 and -2^12 at input 2i+4, zeros elsewhere. Times a row of 2^12 its terms are 2^24, 1, 1,
    -2^24: summed in one block the ones are lost against 2^24 (each half its fp32 spacing, rounded
    to even) and the sum is 0; with a block starting at input 2i+2 that block sums to 2 - 2^24 and
    the total is 2, which survives the output's rounding to bf16."""
    i = (first + torch.arange(out)) % (inp // 2 - 2)
    w = torch.zeros(out, inp)
    rows = torch.arange(out)
    w[rows, 2 * i] = 2.0**12
    w[rows, 2 * i + 2] = w[rows, 2 * i + 3] = 2.0**-12
    w[rows, 2 * i + 4] = -(2.0**12)
    return w.to(torch.bfloat16)


def _pair_blocks(lib, weight: torch.Tensor) -> tuple[int, int] | None:
    """The input blocks (for one row, for more) with which `_Pairs` gives `_Packed`'s products for
    this weight's shape bit for bit, or None (another CPU's oneDNN kernels: AMX tiles sum in
    another order). Found once per shape and thread count in a process, from PAIR_BLOCKS: on
    `_boundary_probe` weights, whose every column differs if a block boundary differs (all pairs
    covered), and on products of the weight itself by random rows."""
    key = (*weight.shape, torch.get_num_threads())
    if key not in _blocks:
        out, inp = weight.shape
        weights = [_boundary_probe(out, inp, first) for first in range(0, inp // 2 - 2, out)] + [weight]
        g = torch.Generator().manual_seed(0)
        agree = dict.fromkeys([(rows, block) for rows in (1, 8, 37) for block in PAIR_BLOCKS], True)
        for w in weights:
            onednn, pairs = _Packed(w), _Pairs(lib, w)
            for rows in (1, 8, 37):
                x = torch.randn(rows, inp, generator=g) if w is weight else torch.full((rows, inp), 2.0**12)
                x = x.to(torch.bfloat16)
                want = onednn(x)
                for block in PAIR_BLOCKS:
                    if agree[rows, block]:
                        pairs.blocks = (block, block)
                        agree[rows, block] = torch.equal(pairs(x), want)
        one = next((b for b in PAIR_BLOCKS if agree[1, b]), None)
        more = next((b for b in PAIR_BLOCKS if agree[8, b] and agree[37, b]), None)
        _blocks[key] = (one, more) if one and more else None
    return _blocks[key]


def _pairs(weight: torch.Tensor) -> _Pairs | None:
    """`_Pairs` for this weight where it gives `_Packed`'s values: a CPU bf16 weight of a multiple of
    32 rows and an even number (≥ 6) of columns, keel.native's AVX512-BF16 kernels built and not
    turned off (KEEL_DPBF16=0), oneDNN with bf16 kernels to agree with."""
    out, inp = weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or out % 32 or inp % 2 or inp < 6 or not _onednn_bf16():
        return None
    lib = native.ops()
    if "dpbf16" not in native.bf16_kernels(lib):
        return None
    blocks = _pair_blocks(lib, weight)
    return _Pairs(lib, weight, blocks) if blocks else None


def laid_out(weight: torch.Tensor, rows: int = FP32_PACKED_MIN_ROWS):
    """The decode step's product by `weight`: a function x ↦ x @ weight.T for x [n, in], laid out
    for a batch of `rows` rows (the decode step's; blocks have more)."""
    pairs = _pairs(weight)
    if pairs is not None:
        return pairs
    if _packs(weight, rows):
        return _Packed(weight)
    transposed = weight.T
    return transposed.__rmatmul__  # x ↦ x @ transposed


def _rotary_in_place(lib, qkv, cos, sin, rows: int, heads: int, d: int, stride: int, bf16: int) -> None:
    """keel_rotary on the first `heads` heads of each of the `rows` rows of qkv [rows, stride] (q
    then k heads side by side, each of dim d), in place; cos, sin [rows, d] in qkv's dtype."""
    lib.keel_rotary(qkv.data_ptr(), stride, d, 0, bf16, cos.data_ptr(), sin.data_ptr(), bf16, d, qkv.data_ptr(), stride, d, 0, bf16, 0,
                    rows, heads, 1, d)


def _split_heads(qkv, heads: int, kv_heads: int, head_dim: int):
    """The q/k/v GEMM's output [B, (H + 2·KV)·D] as views: q and k side by side [B, H + KV, D], v [B, KV, D]."""
    B, k_end = qkv.shape[0], (heads + kv_heads) * head_dim
    return qkv[:, :k_end].view(B, heads + kv_heads, head_dim), qkv[:, k_end:].view(B, kv_heads, head_dim)


class _TorchOps:
    """The decode step's element-wise work as torch ops (any device, any dtype)."""

    def __init__(self, eps: float):
        self.eps = eps

    def norm(self, h, delta, weight):
        """(h + delta, RMSNorm(h + delta) · weight); delta None: no residual add."""
        if delta is not None:
            h = h + delta
        return h, _rms(h, weight, self.eps)

    def rotary(self, qkv, cos, sin, heads: int, kv_heads: int, head_dim: int):
        """q, k (rotary applied to both in one set of element-wise ops: they sit side by side in
        the q/k/v GEMM's output) and v, as [B, heads, D] views."""
        qk, v = _split_heads(qkv, heads, kv_heads, head_dim)
        qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        return qk[:, :heads], qk[:, heads:], v

    def swiglu(self, gu, intermediate: int):
        gate, up = gu.split(intermediate, dim=-1)
        return F.silu(gate) * up

    def prepare(self, attn, P: int, heads: int, kv_heads: int, dtype, head_dim: int):
        """The step's mask as `attend` takes it, computed once for all layers."""
        own = attn[:, P:].bool()[:, None, None, :]  # [B, 1, 1, L+1]
        return cascade._rows_mask(own, heads // kv_heads, dtype) if P else own

    def attend(self, i: int, q, layer, keys, values, mask, scale: float):
        """q [B, H, D] over [the layer's shared prefix ‖ keys/values [B, KV, L+1, D]] → [B, H·D]."""
        return _attention(q[:, :, None, :], layer, keys, values, mask, scale).reshape(q.shape[0], -1)


def _attention(q, layer, keys, values, mask, scale: float):
    """q [B, H, Q, D] over [the layer's shared prefix ‖ keys/values [B, KV, L, D]] in torch ops →
    [B, H, Q, D]: keel.cascade's split attention (`mask` as cascade._rows_mask prepares it), or
    one SDPA call without a prefix (`mask` boolean [B, 1, Q, L], True = visible)."""
    if layer.prefix is not None:
        return cascade.split_attention(q, layer.prefix[0], layer.prefix[1], keys, values, None, scale, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def _round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m (the kernels' vector width 16, the tiles' pairs of 16: 32)."""
    return -(-n // m) * m


class _NativeOps:
    """The same work through keel/decode_ops.c (keel.native): one call per fused group, the same
    roundings in fp32 or bf16; contiguous CPU tensors only. The residual stream h is updated in
    place (the step owns it: the embedding lookup's fresh output)."""

    KERNELS = ("fp32", "amx", "dpbf16")  # the attention's ways with the shared prefix (`kernel`)

    def __init__(self, lib, eps: float, dtype: torch.dtype, kernel: str | None = None):
        """`kernel`: how the attention reads the shared prefix. "fp32": keel_decode_attention (the
        prefix in fp32, the only one for fp32 models); "amx", "dpbf16": bf16 models only, the
        prefix in bf16 with fp32 sums, on AMX tiles or AVX512-BF16 dot products (native.bf16_kernels
        says which this CPU has). None: the fastest this CPU and dtype have."""
        self.lib, self.eps, self.bf16 = lib, eps, int(dtype == torch.bfloat16)
        possible = ["fp32"] + (native.bf16_kernels(lib) if self.bf16 else [])
        if kernel is None:
            kernel = possible[1] if len(possible) > 1 else "fp32"
        if kernel not in self.KERNELS:
            raise ValueError(f"keel.decode: attention kernel {kernel!r} is none of {', '.join(self.KERNELS)}")
        if kernel not in possible:
            raise ValueError(f"keel.decode: the {kernel!r} attention kernel cannot run here for {dtype} "
                             f"(available: {', '.join(possible)})")
        self.kernel = kernel
        self.paired = kernel != "fp32"  # the prefix in bf16, pairs side by side (`_prefix`)
        self._prefixes: dict[int, tuple] = {}  # layer → (prefix keys it was made from, keys and values as the kernel reads them)

    @staticmethod
    def serves(d: "LeanDecoder") -> bool:
        """Whether the kernels cover this model and weights: CPU, fp32 or bf16, rows of a multiple
        of 16 values, head dim 32, 64 or 128, 1, 2, 3, 4 or 8 query heads per kv head (the
        attention kernel is compiled for each of those shapes; SmolLM2-135M: 64 and 3)."""
        embed = d.embed
        return (embed.device.type == "cpu" and embed.dtype in (torch.float32, torch.bfloat16) and embed.shape[1] % 16 == 0
                and d.intermediate % 16 == 0 and d.head_dim in (32, 64, 128) and d.heads % d.kv_heads == 0
                and d.heads // d.kv_heads in (1, 2, 3, 4, 8))

    def norm(self, h, delta, weight):
        out = torch.empty_like(h)
        self.lib.keel_add_rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                   h.shape[0], h.shape[1], self.eps, self.bf16)
        return h, out

    def rotary(self, qkv, cos, sin, heads: int, kv_heads: int, head_dim: int):
        _rotary_in_place(self.lib, qkv, cos, sin, qkv.shape[0], heads + kv_heads, head_dim, qkv.shape[1], self.bf16)
        qk, v = _split_heads(qkv, heads, kv_heads, head_dim)
        return qk[:, :heads], qk[:, heads:], v

    def swiglu(self, gu, intermediate: int):
        out = gu.new_empty(gu.shape[0], intermediate)
        self.lib.keel_silu_mul(gu.data_ptr(), out.data_ptr(), gu.shape[0], intermediate, self.bf16)
        return out

    def prepare(self, attn, P: int, heads: int, kv_heads: int, dtype, head_dim: int):
        """(the mask as int64 rows, the attention's fp32 scratch): one allocation a step, shared by
        every layer."""
        mask = attn if attn.dtype == torch.int64 and attn.is_contiguous() else attn.to(torch.int64).contiguous()
        kind = self.KERNELS.index(self.kernel) if P > 0 else 0  # keel_attention_scratch's: 0 fp32, 1 amx, 2 dpbf16
        floats = self.lib.keel_attention_scratch(attn.shape[0], heads, kv_heads, head_dim, P, attn.shape[1] - P, kind)
        return mask, torch.empty(floats, dtype=torch.float32)

    def _prefix(self, i: int, layer):
        """The layer's shared prefix as the kernel reads it, made once per prefix: fp32 keys
        transposed [KV, D, P16] and values [KV, P16, D], zero-padded to a multiple of 16 positions;
        for the bf16 kernels (amx, dpbf16) bf16 keys and values [KV, P32/2, D, 2] (pairs of
        consecutive dims, resp. positions, side by side: the tiles' layout, and one pair per 32-bit
        lane for VDPBF16PS), zero-padded to 32 — keys [KV, D/2, P32, 2] for amx (tile rows),
        [KV, P32/32, D/2, 32, 2] for dpbf16 (each block of 32 keys contiguous: read cold from
        memory in a decode step, one stream a block is what the prefetchers follow)."""
        pk, pv = layer.prefix
        got = self._prefixes.get(i)
        if got is None or got[0] is not pk:
            KV, P, D = pk.shape[1:]
            if self.paired:
                P32 = _round_up(P, 32)
                keys = pk.new_zeros(KV, P32, D)
                keys[:, :P] = pk[0]
                values = pv.new_zeros(KV, P32, D)
                values[:, :P] = pv[0]
                if self.kernel == "amx":  # the tiles' rows: [KV, D/2, P32, 2]
                    keys = keys.view(KV, P32, D // 2, 2).permute(0, 2, 1, 3)
                else:  # blocks of 32 keys, each [D/2, 32, 2] contiguous: one stream a block
                    keys = keys.view(KV, P32 // 32, 32, D // 2, 2).permute(0, 1, 3, 2, 4)
                got = (pk, keys.contiguous(), values.view(KV, P32 // 2, 2, D).permute(0, 1, 3, 2).contiguous())
            else:
                P16 = _round_up(P, 16)
                kt = pk.new_zeros(KV, D, P16, dtype=torch.float32)
                kt[:, :, :P] = pk[0].transpose(1, 2)
                vp = pk.new_zeros(KV, P16, D, dtype=torch.float32)
                vp[:, :P] = pv[0]
                got = (pk, kt, vp)
            self._prefixes[i] = got
        return got[1:]

    def attend(self, i: int, q, layer, keys, values, prepared, scale: float):
        B, H, D = q.shape
        if keys.stride() != values.stride() or keys.stride()[2:] != (D, 1) or q.stride()[1:] != (D, 1):
            raise RuntimeError(f"keel.decode: keys {tuple(keys.stride())}, values {tuple(values.stride())}, queries "
                               f"{tuple(q.stride())}: the kernel reads rows of {D} contiguous values")
        return self._attention(i, q.data_ptr(), q.stride(0), layer, keys, values, keys.shape[2], prepared, B, H, keys.shape[1], D,
                               scale, q.new_empty(B, H * D))

    def rotary_attend(self, i: int, qkv, cos, sin, layer, prepared, heads: int, kv_heads: int, head_dim: int, scale: float):
        """`rotary`, the keys' and values' append and `attend` in three kernel calls, the queries,
        keys and values read in place from the rows of qkv [B, (H + 2·KV)·D] and the new column
        written into the cache's buffers (`_GrowingLayer.columns`): the same values as those
        three, without the per-layer views and copies (~2 ms of Python a step at batch 16, 30
        layers). None, with nothing done, where the layer cannot be appended to in place (its
        buffers full or not made yet): the caller takes the other way."""
        B, D = qkv.shape[0], head_dim
        if qkv.stride(1) != 1:
            raise RuntimeError(f"keel.decode: qkv {tuple(qkv.stride())}: the kernels read rows of contiguous values")
        got = layer.columns(1) if hasattr(layer, "columns") else None
        if got is None:
            return None
        kbuf, vbuf, n = got  # `update`'s own buffers: contiguous [B, KV, capacity, D], both of one shape
        row = qkv.stride(0)
        _rotary_in_place(self.lib, qkv, cos, sin, B, heads + kv_heads, D, row, self.bf16)
        self.lib.keel_append_kv(qkv.data_ptr(), row, kbuf.data_ptr(), vbuf.data_ptr(), kbuf.stride(0), kbuf.stride(1), n, B, heads,
                                kv_heads, D, self.bf16)
        return self._attention(i, qkv.data_ptr(), row, layer, kbuf, vbuf, n + 1, prepared, B, heads, kv_heads, D, scale,
                               qkv.new_empty(B, heads * D))

    def _attention(self, i: int, q_ptr: int, q_row: int, layer, keys, values, L: int, prepared, B: int, H: int, KV: int, D: int,
                   scale: float, out):
        """The attention kernel over [the layer's shared prefix ‖ the first L columns of keys and
        values [B, KV, ≥ L, D]] for the queries at q_ptr (rows of q_row values, heads of D) → out
        [B, H·D]."""
        mask, scratch = prepared
        prefix = self._prefix(i, layer) if layer.prefix is not None else None  # (keys, values) as the kernel reads them
        P = layer.prefix[0].shape[-2] if prefix is not None else 0
        if mask.shape[1] != P + L:
            raise RuntimeError(f"keel.decode: the mask covers {mask.shape[1]} keys, the layer has {P} shared + {L} own")
        own = (keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), L, mask.data_ptr() + P * mask.element_size(),
               mask.stride(0), out.data_ptr(), scratch.data_ptr(), B, H, KV, D, scale)
        if self.paired and prefix is not None:
            kernel = self.lib.keel_decode_attention_amx if self.kernel == "amx" else self.lib.keel_decode_attention_dpbf16
            kernel(q_ptr, q_row, prefix[0].data_ptr(), prefix[1].data_ptr(), P, *own)
        else:
            kt, vp = (t.data_ptr() for t in prefix) if prefix is not None else (None, None)
            self.lib.keel_decode_attention(q_ptr, q_row, kt, vp, P, _round_up(P, 16), *own, self.bf16)
        return out


class _FusedLayers:
    """A decode step's decoder layers in one call of keel_decode_layers (keel/decode_ops.c): the
    calls `LeanDecoder._layers` makes through `_NativeOps.rotary_attend`, made by C in the same
    order on buffers of the same shapes, so logits and cache are the same bit for bit
    (tests/test_native.py); at 8 rows the Python and ctypes between the kernels were 1.5–1.7 ms of
    a ~14 ms bf16 step (LOG.md, fortieth session). For a bf16 decoder on `_NativeOps` whose every layer product is `_Pairs`
    (AVX512-BF16; `build` gives None otherwise, and KEEL_FUSED_STEP=0 in the environment turns it
    off). The table holds each layer's weights, norms and input blocks; its cache buffers and
    prefix layout are filled in every step."""

    COLUMNS = 6  # the table's first per-step column: key buffer, value buffer, prefix keys, prefix values

    def __init__(self, decoder: "LeanDecoder"):
        self.ops = decoder.ops  # the ops it was made for (a caller may swap the decoder's); ops.lib runs it
        fields = self.ops.lib.keel_decode_layer_fields()
        rows = []
        for w in decoder.layers:
            products = (w.wqkv, w.wo, w.wgu, w.wdown)
            rows.append([p.packed.data_ptr() for p in products] + [w.ln1.data_ptr(), w.ln2.data_ptr(), 0, 0, 0, 0]
                        + [b for p in products for b in p.blocks])
        self.table = torch.tensor(rows, dtype=torch.int64)
        if self.table.shape[1] != fields:
            raise RuntimeError(f"keel.decode: keel_decode_layers reads {fields} fields a layer, the table has {self.table.shape[1]}")

    @staticmethod
    def build(decoder: "LeanDecoder") -> "_FusedLayers | None":
        ops = decoder.ops
        if (os.environ.get("KEEL_FUSED_STEP", "1") == "0" or not isinstance(ops, _NativeOps) or not ops.bf16
                or not all(isinstance(p, _Pairs) for w in decoder.layers for p in (w.wqkv, w.wo, w.wgu, w.wdown))
                or not all(t.dtype == torch.bfloat16 and t.is_contiguous() for w in decoder.layers for t in (w.ln1, w.ln2))
                or decoder.norm.dtype != torch.bfloat16 or not decoder.norm.is_contiguous()):
            return None
        return _FusedLayers(decoder)

    def __call__(self, d: "LeanDecoder", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prepared, cache) -> torch.Tensor | None:
        """The final norm's output [B, hidden] after every layer (h updated in place, each layer's
        cache one column longer), or None with nothing done where the cache cannot be appended to
        in place this step (buffers full or not the layers' own, layers of different lengths,
        layouts): the caller then runs the per-layer loop."""
        layers = cache.layers
        if len(layers) != len(d.layers) or not hasattr(layers[0], "free_columns"):
            return None
        free = [layer.free_columns(1) for layer in layers]
        if any(f is None for f in free):
            return None
        kbuf, vbuf, n = free[0]
        if any(f[2] != n or f[0].stride() != kbuf.stride() or f[1].stride() != kbuf.stride() for f in free):
            return None
        prefixes = [layer.prefix for layer in layers]
        P = prefixes[0][0].shape[-2] if prefixes[0] is not None else 0
        if any((p[0].shape[-2] if p is not None else 0) != P for p in prefixes):
            return None
        mask, scratch = prepared
        if mask.shape[1] != P + n + 1:
            raise RuntimeError(f"keel.decode: the mask covers {mask.shape[1]} keys, the layers have {P} shared + {n + 1} own")
        ops = d.ops
        laid = [ops._prefix(i, layer) for i, layer in enumerate(layers)] if P else [(None, None)] * len(layers)
        kernel = ops.KERNELS.index(ops.kernel) if P else 0
        for layer, f in zip(layers, free):
            if layer.columns(1, f) is None:
                raise RuntimeError("keel.decode: a cache layer refused the columns its free_columns offered")
        c = self.COLUMNS
        self.table[:, c : c + 4] = torch.tensor([[f[0].data_ptr(), f[1].data_ptr(), k.data_ptr() if k is not None else 0,
                                                  v.data_ptr() if v is not None else 0] for f, (k, v) in zip(free, laid)])
        B, hidden = h.shape
        H, KV, D, I = d.heads, d.kv_heads, d.head_dim, d.intermediate
        x, o, down = h.new_empty(B, hidden), h.new_empty(B, hidden), h.new_empty(B, hidden)
        qkv, att, gu, act = h.new_empty(B, (H + 2 * KV) * D), h.new_empty(B, H * D), h.new_empty(B, 2 * I), h.new_empty(B, I)
        ops.lib.keel_decode_layers(self.table.data_ptr(), len(layers), h.data_ptr(), x.data_ptr(), qkv.data_ptr(), att.data_ptr(),
                                    o.data_ptr(), gu.data_ptr(), act.data_ptr(), down.data_ptr(), d.norm.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), mask.data_ptr(), mask.stride(0), scratch.data_ptr(), kbuf.stride(0), kbuf.stride(1),
                                    n, P, kernel, B, hidden, H, KV, D, I, ops.eps, d.scale)
        return x


class _Layer:
    __slots__ = ("wqkv", "wo", "wgu", "wdown", "ln1", "ln2")

    def __init__(self, layer, rows: int):
        a, m = layer.self_attn, layer.mlp
        self.wqkv = laid_out(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(), rows)
        self.wo = laid_out(a.o_proj.weight.detach(), rows)
        self.wgu = laid_out(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), rows)
        self.wdown = laid_out(m.down_proj.weight.detach(), rows)
        self.ln1 = layer.input_layernorm.weight.detach()
        self.ln2 = layer.post_attention_layernorm.weight.detach()


class LeanDecoder:
    """One decode step of a Llama-family causal LM over a keel.rollout KV cache (see module doc).

    The concatenated and laid-out weights are copies: build a new decoder after the weights
    change (the rollout builds one per call: 0.09 s for SmolLM2 in bf16 with the layout, 0.01 s
    without, on the AMX Xeon of LOG.md's twenty-fifth session; 0.2 s in fp32 with the layout,
    thirty-first session). `rows`: the rollout's batch, which decides whether fp32 weights are
    laid out (`laid_out`)."""

    def __init__(self, model, rows: int = FP32_PACKED_MIN_ROWS):
        c = model.config
        inner = model.model
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.intermediate = c.intermediate_size
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = laid_out(model.lm_head.weight.detach(), rows)
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        with torch.no_grad():
            self.layers = [_Layer(layer, rows) for layer in inner.layers]
        lib = native.ops() if _NativeOps.serves(self) else None
        self.ops = _NativeOps(lib, self.eps, self.embed.dtype) if lib is not None else _TorchOps(self.eps)
        self.fused = _FusedLayers.build(self)  # None: the per-layer loop

    @staticmethod
    def build(model, rows: int = FP32_PACKED_MIN_ROWS) -> "LeanDecoder | None":
        """The decoder for `model` and a batch of `rows` rows, or None when its layout is not the plain Llama one."""
        c = getattr(model, "config", None)
        if c is None or type(model).__name__ != "LlamaForCausalLM":
            return None
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or getattr(c, "hidden_act", "silu") != "silu"
                or rope.get("rope_type", "default") != "default" or getattr(c, "pretraining_tp", 1) != 1):
            return None
        return LeanDecoder(model, rows)

    def _rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D] in `dtype` for positions [N], as transformers' rotary embedding computes them."""
        freqs = positions.float()[:, None] * self.inv_freq  # [N, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    @torch.no_grad()
    def block(self, tokens: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """W new tokens per row at once (a rollout's tool-response blocks): tokens, positions
        [B, W]; attn [B, P + L + W] over [shared prefix ‖ own cached keys ‖ the block] (1 =
        visible); each block token also sees the block's earlier columns, not its later ones
        (transformers' causal mask over cache columns). Appends the block's keys and values to
        the cache in place and returns the last column's next-token logits [B, V] in fp32.

        The same function as transformers' forward on that cache, with the decode step's layer
        loop: concatenated laid-out weights, the element-wise groups as one kernel call each over
        all B·W rows (or the torch ops), and the attention as keel.cascade's split attention over
        the shared prefix and the rows' own keys (one SDPA call without a prefix)."""
        B, W = tokens.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        # only the block's real tokens go through the GEMMs and element-wise work (ragged blocks
        # are a third padding); the attention runs on the full [B, W] layout, hidden columns'
        # queries, keys and values zero (their keys are never visible: the mask hides them)
        index = attn[:, -W:].reshape(-1).nonzero().squeeze(1)  # [N]: the real positions of the [B·W] rows
        h = F.embedding(tokens.reshape(-1).index_select(0, index), self.embed)  # [N, hidden]
        dtype = h.dtype
        cos, sin = self._rotary_tables(positions.reshape(-1).index_select(0, index), dtype)
        prefix = getattr(cache.layers[0], "prefix", None)
        P = prefix[0].shape[-2] if prefix is not None else 0
        own = attn[:, P:].bool()  # [B, N]: the rows' cached columns, then the block's W
        N = own.shape[1]
        causal = torch.arange(N, device=attn.device)[None, :] <= torch.arange(N - W, N, device=attn.device)[:, None]  # [W, N]
        mask = own[:, None, None, :] & causal[None, None]  # [B, 1, W, N]
        prepared = cascade._rows_mask(mask, H // KV, dtype) if prefix is not None else mask

        def spread(x):  # [N, ...] → [B, W, ...]: the real positions' rows in place, hidden ones zero
            out = x.new_zeros(B * W, *x.shape[1:])
            out[index] = x
            return out.view(B, W, *x.shape[1:])

        def attend(i, qkv):  # [N, (H + 2·KV)·D] → [N, H·D]
            q, k, v = self.ops.rotary(qkv, cos, sin, H, KV, D)  # [N, heads, D]
            layer = cache.layers[i]
            keys, values = layer.update(spread(k).transpose(1, 2), spread(v).transpose(1, 2))
            out = _attention(spread(q).transpose(1, 2), layer, keys, values, prepared, self.scale)  # [B, H, W, D]
            return out.transpose(1, 2).reshape(B * W, H * D).index_select(0, index)

        x = self._layers(h, attend)  # [N, hidden]
        return self.lm_head(spread(x)[:, -1].contiguous()).float()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens, positions [B, 1]; attn [B, P + L + 1] over [shared prefix ‖ own cached keys ‖
        this token] (1 = visible); cache: the rollout's DynamicCache of growing layers, appended
        in place. Returns the next-token logits [B, V] in fp32."""
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(tokens[:, 0], self.embed)  # [B, hidden]
        dtype = h.dtype
        cos, sin = self._rotary_tables(positions[:, 0], dtype)  # [B, D]
        prefix = getattr(cache.layers[0], "prefix", None)
        ops = self.ops
        mask = ops.prepare(attn, prefix[0].shape[-2] if prefix is not None else 0, H, KV, dtype, D)

        in_place = isinstance(ops, _NativeOps)
        if self.fused is not None and ops is self.fused.ops:
            x = self.fused(self, h, cos, sin, mask, cache)
            if x is not None:
                return self.lm_head(x).float()

        def attend(i, qkv):  # [B, (H + 2·KV)·D] → [B, H·D]
            layer = cache.layers[i]
            if in_place:
                out = ops.rotary_attend(i, qkv, cos, sin, layer, mask, H, KV, D, self.scale)
                if out is not None:
                    return out
            q, k, v = ops.rotary(qkv, cos, sin, H, KV, D)  # [B, heads, D]
            keys, values = layer.update(k[:, :, None, :], v[:, :, None, :])  # [B, KV, L+1, D]
            return ops.attend(i, q, layer, keys, values, mask, self.scale)

        return self.lm_head(self._layers(h, attend)).float()

    def _layers(self, h: torch.Tensor, attend) -> torch.Tensor:
        """The decoder layers over the rows of h [N, hidden] (the embeddings; updated in place by
        the native ops); `attend(i, qkv)` applies rotary to layer i's q/k/v GEMM output [N,
        (H + 2·KV)·D], appends its keys and values to the cache and returns the attention output
        [N, H·D]. Returns the final RMSNorm's output [N, hidden]."""
        ops = self.ops
        h, x = ops.norm(h, None, self.layers[0].ln1)
        for i, w in enumerate(self.layers):
            h, x = ops.norm(h, w.wo(attend(i, w.wqkv(x))), w.ln2)
            delta = w.wdown(ops.swiglu(w.wgu(x), self.intermediate))
            h, x = ops.norm(h, delta, self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm)
        return x

