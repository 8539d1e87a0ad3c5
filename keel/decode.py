"""A lean decode step for Llama-family models: one new token per row, on pre-laid-out weights.

transformers' forward spends most of a CPU decode step outside its matrix multiplies: at batch
16 in bf16, SmolLM2's 211 linear layers take ~30 ms per step, the whole forward ~70–80 ms
(`bench/sampler_vs_generate.py` prints both). The rest is per-layer module dispatch, mask and
rotary construction for every call, dtype round trips in RMSNorm, and seven GEMMs per layer
where four do the same work. `LeanDecoder.step` computes the same function with
- q, k and v projections as one GEMM, gate and up as one (weights concatenated once per rollout);
- bf16 weights laid out once per rollout in oneDNN's blocked format (`laid_out`), not on every call;
- RMSNorm as one fused `torch.rms_norm` in fp32, cast back before the weight, as transformers does;
- rotary cos/sin computed once per step for all layers, from the rows' positions, and applied to
  q and k in one set of element-wise ops (they sit side by side in the q/k/v GEMM's output);
- the decode mask prepared once per step (`keel.cascade._rows_mask`) for all layers;
- attention through keel.cascade's split attention when the cache holds a shared prefix, else
  one SDPA call over the rows' own keys;
- keys and values appended in place to the rollout's growing cache (`cache.layers[i].update`).

It is used only for width-1 decode steps of `keel.rollout`; prefill and the tool-response blocks
still run transformers' forward into the same cache. `tests/test_decode.py` checks the logits
against transformers' forward on the same cache (fp32, with and without a shared prefix).
Models it does not cover (biases, other rotary types, sliding windows, non-Llama layouts) get
None from `LeanDecoder.build` and keep transformers' forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from keel import cascade


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class _Packed:
    """x ↦ x @ weight.T with a bf16 weight [out, in] laid out once in oneDNN's blocked format for
    its matrix-multiply kernels. `x @ weight.T` on a plain tensor lays the weight out again on
    every call: at decode shapes (batch 16) the packed GEMM takes half the time (SmolLM2's q/k/v
    block: 37 vs 79 µs on an AMX Xeon) and gives the same values bit for bit
    (tests/test_decode.py). Called directly: `x @ packed` through `__rmatmul__` cost 18 µs a
    call more (torch's operator tries the tensor product first)."""

    __slots__ = ("packed",)

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@functools.cache
def _onednn_bf16() -> bool:
    """Whether this process's oneDNN has bf16 kernels and torch the ops that lay weights out."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _packs(weight: torch.Tensor) -> bool:
    """Whether `_Packed` serves this weight: bf16 on a CPU whose oneDNN has bf16 kernels."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _onednn_bf16()


def laid_out(weight: torch.Tensor):
    """The decode step's product by `weight`: a function x ↦ x @ weight.T."""
    if _packs(weight):
        return _Packed(weight)
    transposed = weight.T
    return transposed.__rmatmul__  # x ↦ x @ transposed


def _attention_in(h, ln1, wqkv, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    """A layer's input norm, its q/k/v projection as one GEMM, and rotary on q and k together
    (one set of element-wise ops over H + KV heads instead of two: the same values).
    Weights as `laid_out` gives them (`w(x)` = x @ weight.T)."""
    B = h.shape[0]
    qkv = wqkv(_rms(h, ln1, eps))  # [B, (H + 2·KV)·D]
    k_end = (heads + kv_heads) * head_dim
    qk = qkv[:, :k_end].view(B, heads + kv_heads, head_dim)
    qk = qk * cos + rotate_half(qk) * sin
    v = qkv[:, k_end:].view(B, kv_heads, head_dim)
    return qk[:, :heads], qk[:, heads:], v


def _attention_out_mlp(h, attended, wo, ln2, wgu, wdown, eps: float, intermediate: int):
    """The attention's output projection and residual, then the MLP block and its residual."""
    h = h + wo(attended)
    gate, up = wgu(_rms(h, ln2, eps)).split(intermediate, dim=-1)
    return h + wdown(F.silu(gate) * up)


class _Layer:
    __slots__ = ("wqkv", "wo", "wgu", "wdown", "ln1", "ln2")

    def __init__(self, layer):
        a, m = layer.self_attn, layer.mlp
        self.wqkv = laid_out(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach())
        self.wo = laid_out(a.o_proj.weight.detach())
        self.wgu = laid_out(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach())
        self.wdown = laid_out(m.down_proj.weight.detach())
        self.ln1 = layer.input_layernorm.weight.detach()
        self.ln2 = layer.post_attention_layernorm.weight.detach()


class LeanDecoder:
    """One decode step of a Llama-family causal LM over a keel.rollout KV cache (see module doc).

    The concatenated and laid-out weights are copies: build a new decoder after the weights
    change (the rollout builds one per call: 0.09 s for SmolLM2 in bf16 with the layout, 0.01 s
    without, on the AMX Xeon of LOG.md's twenty-fifth session)."""

    def __init__(self, model):
        c = model.config
        inner = model.model
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.intermediate = c.intermediate_size
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = laid_out(model.lm_head.weight.detach())
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        with torch.no_grad():
            self.layers = [_Layer(layer) for layer in inner.layers]

    @staticmethod
    def build(model) -> "LeanDecoder | None":
        """The decoder for `model`, or None when its layout is not the plain Llama one."""
        c = getattr(model, "config", None)
        if c is None or type(model).__name__ != "LlamaForCausalLM":
            return None
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or getattr(c, "hidden_act", "silu") != "silu"
                or rope.get("rope_type", "default") != "default" or getattr(c, "pretraining_tp", 1) != 1):
            return None
        return LeanDecoder(model)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens, positions [B, 1]; attn [B, P + L + 1] over [shared prefix ‖ own cached keys ‖
        this token] (1 = visible); cache: the rollout's DynamicCache of growing layers, appended
        in place. Returns the next-token logits [B, V] in fp32."""
        B = tokens.shape[0]
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(tokens[:, 0], self.embed)  # [B, hidden]
        dtype = h.dtype
        freqs = positions[:, 0, None].float() * self.inv_freq  # [B, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)[:, None, :]  # [B, 1, D]
        sin = (emb.sin() * self.rope_scaling).to(dtype)[:, None, :]
        prefix = getattr(cache.layers[0], "prefix", None)
        P = prefix[0].shape[-2] if prefix is not None else 0
        own = attn[:, P:].bool()[:, None, None, :]  # [B, 1, 1, L+1]
        if prefix is not None:
            prepared = cascade._rows_mask(own, H // KV, dtype)
        else:
            sdpa_mask = own
        for i, w in enumerate(self.layers):
            q, k, v = _attention_in(h, w.ln1, w.wqkv, cos, sin, self.eps, H, KV, D)
            layer = cache.layers[i]
            keys, values = layer.update(k[:, :, None, :], v[:, :, None, :])  # [B, KV, L+1, D]
            if prefix is not None:
                pk, pv = layer.prefix
                out = cascade.split_attention(q[:, :, None, :], pk, pv, keys, values, None, self.scale, prepared)
            else:
                out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=sdpa_mask, scale=self.scale,
                                                     enable_gqa=True)
            h = _attention_out_mlp(h, out.reshape(B, H * D), w.wo, w.ln2, w.wgu, w.wdown, self.eps, self.intermediate)
        h = _rms(h, self.norm, self.eps)
        return self.lm_head(h).float()

