"""Hand-computed values for advantages, the clipped surrogate, KL estimators, aggregation, SFT."""

import math

import pytest
import torch

from keel.losses import aggregate, batch_advantages, batch_stats, clipped_surrogate, group_advantages, kl_estimate, sft_loss


def test_group_advantages_with_std():
    # group 0: rewards [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4·0.25/3) = 0.5773503
    # group 1: [0.2, 0.2]: std 0 → (0.2-0.2)/(0+eps) = 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.2])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = group_advantages(r, g, scale_by_std=True)
    expected = 0.5 / (0.5773503 + 1e-6)
    assert a[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-5)
    assert a[4:].tolist() == [0.0, 0.0]


def test_group_advantages_without_std_and_singleton():
    # group 0: [3, 1, 2] mean 2 → [1, -1, 0]; group 1 has one member → 0
    r = torch.tensor([3.0, 1.0, 2.0, 5.0])
    g = torch.tensor([0, 0, 0, 1])
    assert group_advantages(r, g, scale_by_std=False).tolist() == [1.0, -1.0, 0.0, 0.0]


def test_batch_advantages_by_hand():
    # Two groups: all success, and one of four. Mean 0.625, unbiased std sqrt(1.875 / 7).
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    mean, std = batch_stats(float(rewards.sum()), float((rewards ** 2).sum()), 8)
    assert mean == 0.625 and std == pytest.approx(0.517549, abs=1e-6)
    assert std == pytest.approx(float(rewards.std()), abs=1e-7)
    adv = batch_advantages(rewards, mean, std)
    assert adv[:5].tolist() == pytest.approx([0.724567] * 5, abs=1e-6)  # the uniform group trains too
    assert adv[5:].tolist() == pytest.approx([-1.207612] * 3, abs=1e-6)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-5)
    assert batch_advantages(rewards, mean, std, scale_by_std=False).tolist() == pytest.approx([0.375] * 5 + [-0.625] * 3)
    # Group advantages give the uniform group nothing.
    assert group_advantages(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))[:4].tolist() == [0.0] * 4


def test_batch_stats_edge_cases():
    assert batch_stats(0.0, 0.0, 0) == (0.0, 0.0)
    assert batch_stats(1.0, 1.0, 1) == (1.0, 0.0)
    assert batch_stats(2.0, 2.0, 2) == (1.0, 0.0)  # all equal: std 0, never negative from rounding


def test_clipped_surrogate_high_side():
    # A = 1, ratio 1.5 → -min(1.5, 1.2) = -1.2, high clip active; ratio 1.1 → -1.1, not clipped
    logp = torch.log(torch.tensor([1.5, 1.1]))
    old = torch.zeros(2)
    adv = torch.ones(2)
    loss, low, high = clipped_surrogate(logp, old, adv, 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-1.2, -1.1])
    assert high.tolist() == [True, False] and low.tolist() == [False, False]


def test_clipped_surrogate_low_side_and_asymmetric():
    # A = -1, ratio 0.5, clip_low 0.2 → -min(-0.5, -0.8) = 0.8 (low clip active)
    # A = -1, ratio 1.5 → -min(-1.5, -1.28) = 1.5 (the pessimistic unclipped term wins; no flag)
    # A = +1, ratio 1.3, clip_high 0.28 → -min(1.3, 1.28) = -1.28 (high clip active)
    logp = torch.log(torch.tensor([0.5, 1.5, 1.3]))
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, low, high = clipped_surrogate(logp, torch.zeros(3), adv, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([0.8, 1.5, -1.28])
    assert low.tolist() == [True, False, False]
    assert high.tolist() == [False, False, True]


def test_clipped_gradient_is_zero_when_clipped():
    logp = torch.log(torch.tensor([1.5])).requires_grad_()
    loss, _, _ = clipped_surrogate(logp, torch.zeros(1), torch.ones(1))
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_kl_estimators_by_hand():
    # logp = log 0.5, ref = log 0.25: k1 = log 2 = 0.693147; k3 = e^{-log2} + log2 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k2")


def test_k3_is_clamped_like_verl():
    # log-ratio 50 is clamped to 20 → e^20 - 20 - 1 ≈ 4.85e8, then the result clamps to 10
    assert kl_estimate(torch.tensor([-50.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_aggregations_by_hand():
    # seq 0 tokens [1, 2, 3], seq 1 token [4]
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    seq = torch.tensor([0, 0, 0, 1])
    assert aggregate(x, seq, "token-mean", 4, 2).item() == pytest.approx(2.5)  # 10 / 4
    assert aggregate(x, seq, "seq-mean-token-mean", 4, 2).item() == pytest.approx(3.0)  # (6/3 + 4/1) / 2
    with pytest.raises(ValueError, match="loss_aggregation"):
        aggregate(x, seq, "sum", 4, 2)


def test_aggregation_split_over_micro_batches_equals_whole():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0])
    seq = torch.tensor([0, 0, 1, 1, 1])
    whole_tok = aggregate(x, seq, "token-mean", 5, 2)
    parts_tok = aggregate(x[:2], seq[:2], "token-mean", 5, 2) + aggregate(x[2:], seq[2:] - 1, "token-mean", 5, 2)
    assert parts_tok.item() == pytest.approx(whole_tok.item())
    whole_seq = aggregate(x, seq, "seq-mean-token-mean", 5, 2)  # (3/2 + 13/3) / 2 = 2.9166667
    assert whole_seq.item() == pytest.approx(2.9166667, abs=1e-6)
    parts_seq = aggregate(x[:2], seq[:2], "seq-mean-token-mean", 5, 2) + aggregate(x[2:], seq[2:] - 1, "seq-mean-token-mean", 5, 2)
    assert parts_seq.item() == pytest.approx(whole_seq.item())


def test_sft_loss_by_hand():
    # log-probs [log .5, log .25] over 2 targets → (0.693147 + 1.386294) / 2 = 1.039721
    logp = torch.log(torch.tensor([0.5, 0.25]))
    assert sft_loss(logp, 2).item() == pytest.approx(1.039721, abs=1e-6)
