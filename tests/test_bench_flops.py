"""bench/train_flops.py counts the CPU flash-attention kernels' FLOPs itself (torch's flop counter
has no formula for them): only the query–key pairs the mask lets through, worked out by hand."""

import sys
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from train_flops import ATTENTION_FLOPS  # noqa: E402

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _count(fn) -> dict:
    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)
    with counter:
        fn()
    return dict(counter.get_flop_counts()["Global"])


def test_masked_gqa_attention_counts_visible_pairs_forward_and_backward():
    # 2 rows × 4 query heads (2 KV heads) × 3 queries × 5 keys, head dim 8; row 1 hides keys 3–4.
    # Visible pairs per head: row 0 3·5 = 15, row 1 3·3 = 9 → 24 · 4 heads = 96.
    # Forward 4·d per pair: 96·8·4 = 3,072; backward 10·d: 96·8·10 = 7,680.
    q = torch.randn(2, 4, 3, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[1, :, :, 3:] = False
    counts = _count(lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward())
    assert counts == {FWD: 3072, BWD: 7680}


def test_additive_mask_and_causal_attention():
    # Additive float mask: −inf hides a pair. 1 row × 2 heads × 2 queries × 3 keys, one pair hidden
    # → 5 pairs · 2 heads = 10; forward 10·4·4 = 160.
    q, k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    mask = torch.zeros(1, 1, 2, 3)
    mask[0, 0, 0, 2] = float("-inf")
    assert _count(lambda: sdpa(q, k, v, attn_mask=mask)) == {FWD: 160}
    # Causal, 4 queries = 4 keys: 1+2+3+4 = 10 pairs · 2 heads · d 8 · 4 = 640.
    x = torch.randn(1, 2, 4, 8)
    assert _count(lambda: sdpa(x, x, x, is_causal=True)) == {FWD: 640}
