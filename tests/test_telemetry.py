"""Token telemetry: KL estimators, per-class KL (vectorised vs loop), entropy, tag frequencies."""

from __future__ import annotations

import math
import random

import pytest
import torch

from keel.chat import token_tag_labels
from keel.diagnostics.telemetry import (
    ControlFrequencyBaseline,
    control_tag_frequency,
    kl_by_class,
    token_entropy,
    token_telemetry,
    tool_call_tag_balance,
)
from keel.losses import kl_k1, kl_k3


def test_k1_k3_by_hand_and_clamp():
    logp = torch.tensor([math.log(0.5), math.log(0.2), 0.0])
    ref = torch.tensor([math.log(0.25), math.log(0.2), -100.0])
    assert kl_k1(logp, ref).tolist() == pytest.approx([math.log(2), 0.0, 100.0])
    # k3 with d = ref − logp: d = −log 2 → 0.5 + log 2 − 1 = 0.19315; d = 0 → 0;
    # d = −100 clamped to −20 → e^−20 + 20 − 1 ≈ 19, then clamped to 10.
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0, 10.0], abs=1e-6)
    # The other side: d = +30 → clamp 20 → e^20 − 21, clamped to 10.
    assert kl_k3(torch.tensor([-30.0]), torch.tensor([0.0])).item() == 10.0


def test_entropy_matches_direct_formula_and_is_chunk_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g) * 3
    p = torch.softmax(logits, -1)
    direct = -(p * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(token_entropy(logits, chunk_size=3), direct, atol=1e-5)
    assert torch.allclose(token_entropy(logits, chunk_size=1000), direct, atol=1e-5)
    # Uniform over 4 → log 4; one-hot (huge margin) → 0.
    assert token_entropy(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))
    assert token_entropy(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    # Masked vocabulary entries (-inf) drop out: uniform over the 2 unmasked → log 2, not NaN.
    assert token_entropy(torch.tensor([[0.0, float("-inf"), 0.0]])).item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="vocabulary"):
        token_entropy(torch.tensor(1.0))


def test_kl_by_class_worked_example():
    out = kl_by_class(torch.tensor([1.0, 3.0, 0.0, 2.0]), [None, "<tool_call>", None, "<tool_call>"], ["a", "<tool_call>", "b", "<tool_call>"], top_k=2)
    assert out["tag_mean"] == {"<tool_call>": 2.5} and out["text_mean"] == 0.5
    assert out["control_share"] == pytest.approx(5 / 6)
    assert out["top"] == [
        {"piece": "<tool_call>", "total": 5.0, "count": 2, "mean": 2.5, "tag": "<tool_call>"},
        {"piece": "a", "total": 1.0, "count": 1, "mean": 1.0, "tag": None},
    ]
    with pytest.raises(ValueError, match="3 labels"):
        kl_by_class(torch.zeros(4), [None] * 3)


def loop_kl_by_class(kl: list[float], labels, pieces, top_k):
    """Plain Python reference for kl_by_class."""
    sums, counts = {}, {}
    for v, lab in zip(kl, labels):
        key = lab or "text"
        sums[key] = sums.get(key, 0.0) + v
        counts[key] = counts.get(key, 0) + 1
    total = sum(kl)
    control = sum(v for v, lab in zip(kl, labels) if lab is not None)
    per_piece = {}
    for v, p in zip(kl, pieces):
        per_piece[p] = per_piece.get(p, 0.0) + v
    top = sorted(per_piece.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]
    return (
        {k: sums[k] / counts[k] for k in sums if k != "text"},
        sums.get("text", 0.0) / counts["text"] if "text" in counts else 0.0,
        control / total if total > 0 else 0.0,
        [(p, s) for p, s in top],
    )


def test_kl_by_class_equals_loop_on_random_batch():
    rng = random.Random(7)
    vocab = ["the", " a", "<tool_call>", "</tool_call>", "<|im_end|>", "{", "}", "x", "<", "tool", "_", "call", ">"]
    for _ in range(20):
        n = rng.randint(1, 60)
        pieces = [rng.choice(vocab) for _ in range(n)]
        labels = token_tag_labels(pieces)
        kl = [rng.random() * rng.choice([0.01, 1.0, 5.0]) for _ in range(n)]
        out = kl_by_class(torch.tensor(kl, dtype=torch.float64), labels, pieces, top_k=4)
        tag_mean, text_mean, share, top = loop_kl_by_class(kl, labels, pieces, 4)
        assert out["tag_mean"].keys() == tag_mean.keys()
        for k in tag_mean:
            assert out["tag_mean"][k] == pytest.approx(tag_mean[k])
        assert out["text_mean"] == pytest.approx(text_mean) and out["control_share"] == pytest.approx(share)
        assert [(t["piece"], pytest.approx(t["total"])) for t in out["top"]] == [(p, pytest.approx(s)) for p, s in top]


def test_frequency_balance_and_baseline():
    # SmolLM2-like: "</tool_call>" spread over several tokens still counts once.
    t1 = ["<tool_call>", '{"name"', "</", "tool", "_call", ">", "<|im_end|>"]
    t2 = ["<tool_call>", "<tool_call>", "x", "<|im_end|>"]  # spam: 2 open, 0 close
    freqs = control_tag_frequency([t1, t2])
    assert freqs["<tool_call>"] == 1.5 and freqs["</tool_call>"] == 0.5 and freqs["<|im_end|>"] == 1.0
    assert freqs["<answer>"] == 0.0
    # t1: |1 − 1| / 2 = 0; t2: |2 − 0| / 2 = 1 → mean 0.5.
    assert tool_call_tag_balance([t1, t2]) == 0.5
    assert tool_call_tag_balance([["no", "tags"]]) == 0.0
    base = ControlFrequencyBaseline()
    assert base.metrics(freqs) == {}
    base.record({"<tool_call>": 1.0, "<answer>": 0.0})
    base.record({"<tool_call>": 99.0})  # ignored: the baseline is the first record
    m = base.metrics(freqs)
    # (1.5 + 0.1) / (1.0 + 0.1) = 1.4545; (0 + 0.1) / (0 + 0.1) = 1.
    assert m["tokens/freq_ratio/<tool_call>"] == pytest.approx(1.6 / 1.1)
    assert m["tokens/freq_ratio/<answer>"] == pytest.approx(1.0)
    assert m["tokens/freq_ref/<tool_call>"] == 1.0 and m["tokens/freq_max_ratio"] == pytest.approx(1.6 / 1.1)
    restored = ControlFrequencyBaseline()
    restored.load_state_dict(base.state_dict())
    assert restored.metrics(freqs) == m
    with pytest.raises(ValueError, match="baseline"):
        restored.load_state_dict({"baseline": [1, 2]})


def test_token_telemetry_end_to_end():
    pieces = [["Hi", "<tool_call>", "<|im_end|>"], ["ok", "<|im_end|>"]]
    labels = [token_tag_labels(p) for p in pieces]
    logp = [torch.tensor([0.0, math.log(0.5), 0.0]), torch.tensor([0.0, 0.0])]
    ref = [torch.tensor([0.0, math.log(0.25), 0.0]), torch.tensor([0.0, math.log(0.25)])]
    ent = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])]
    m, top = token_telemetry(logp, ref, ent, labels, pieces, top_k=1)
    k = 0.5 + math.log(2) - 1  # k3 when the reference halves the probability: 0.19315
    k2 = 0.25 + math.log(4) - 1  # k3 when it quarters it: 0.63629
    # Only <tool_call> (k) and the second <|im_end|> (k2) carry KL: control share 1, text 0.
    assert m["kl/k3_mean"] == pytest.approx((k + k2) / 5) and m["kl/mean"] == m["kl/k3_mean"]
    assert m["kl/k1_mean"] == pytest.approx((math.log(2) + math.log(4)) / 5)
    assert m["kl/control_share"] == pytest.approx(1.0) and m["kl/text"] == 0.0
    assert m["kl/tag/<tool_call>"] == pytest.approx(k) and m["kl/tag/<|im_end|>"] == pytest.approx(k2 / 2)
    assert m["tokens/entropy"] == pytest.approx(3.0)
    assert m["tokens/freq/<|im_end|>"] == 1.0 and m["tokens/freq/<tool_call>"] == 0.5
    assert m["tokens/tag_balance"] == 0.5  # first trajectory has an unclosed call
    assert top == [{"piece": "<|im_end|>", "total": pytest.approx(k2), "count": 2, "mean": pytest.approx(k2 / 2), "tag": "<|im_end|>"}]
    with pytest.raises(ValueError, match="trajectory 1"):
        token_telemetry(logp, [ref[0], ref[1][:1]], ent, labels, pieces)
    with pytest.raises(ValueError, match="in labels"):
        token_telemetry(logp, ref, ent, labels[:1], pieces)
    m_empty, top_empty = token_telemetry([], [], [], [], [])
    assert top_empty == [] and m_empty["tokens/tag_balance"] == 0.0
