"""GRPO and SFT losses as pure tensor functions.

GRPO (DeepSeekMath; as configured in paper A: group n=8, `low_var_kl` coef 1e-4, entropy 0):
the advantage of each member is its reward minus the group mean, optionally divided by the
group std; the policy loss is PPO's clipped surrogate with separate low/high clip ranges
(DAPO's "clip-higher"); the KL to a frozen reference is added as a loss term (k1 or k3).

Where Keel departs: nothing in the formulas. The group std is the unbiased (n-1) estimate,
as in verl's `compute_grpo_outcome_advantage`; a group of one member gets advantage 0.
An option GRPO does not have: `batch_advantages` centres each reward on the mean of the whole
step's batch instead of its group (REINFORCE with a batch-mean baseline; `grpo.baseline: batch`).
A group whose members all succeed then still gets a positive advantage, so what the policy does
right on one question keeps being reinforced while another question's gradient moves shared
decisions; the advantages still sum to zero over the batch.
Aggregation is a choice: "token-mean" (every policy token of the batch weighs the same, DAPO /
verl default) or "seq-mean-token-mean" (each sequence's mean, then the mean over sequences,
the original GRPO). Normalisers are passed in, so gradient accumulation over micro-batches
reproduces the full-batch loss exactly.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [N], groups [N] (group id per member) → advantages [N].

    Worked example: one group with rewards [1, 0, 0, 1]: mean 0.5, unbiased std
    sqrt((4 · 0.25) / 3) = 0.57735; advantages ±0.5 / (0.57735 + 1e-6) = ±0.866024.
    Without std scaling: [0.5, -0.5, -0.5, 0.5].
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(groups):
        idx = groups == g
        r = rewards[idx].float()
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        adv[idx] = centred / (r.std() + eps) if scale_by_std else centred
    return adv


def batch_advantages(rewards: torch.Tensor, mean: float, std: float, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [N] → (rewards − mean) [/ (std + eps)], with the mean and unbiased std of the
    whole step's rewards passed in (so that data-parallel ranks share one baseline).

    Worked example: a step of two groups, [1, 1, 1, 1] and [1, 0, 0, 0]: mean 5/8 = 0.625,
    unbiased std sqrt((5 · 0.375² + 3 · 0.625²) / 7) = sqrt(1.875 / 7) = 0.517549; the all-success
    group gets +0.375 / (0.517549 + 1e-6) = +0.724567 each (0 under group advantages), the
    failures −0.625 / (0.517549 + 1e-6) = −1.207612.
    """
    centred = rewards.float() - mean
    return centred / (std + eps) if scale_by_std else centred


def batch_stats(total: float, total_sq: float, n: float) -> tuple[float, float]:
    """(mean, unbiased std) from a sum, a sum of squares and a count (0 std below 2 members)."""
    mean = total / n if n else 0.0
    var = (total_sq - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return mean, max(var, 0.0) ** 0.5


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp − ref_logp per token. Shapes: [...] and [...] → [...]. Unbiased, high variance,
    can be negative."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp − logp) − (ref_logp − logp) − 1 per token (Schulman's low-variance
    estimator, verl's `low_var_kl`), ≥ 0.

    Clamped as verl clamps it: the log-ratio to [−20, 20] before exp (exp(20) ≈ 4.9e8 stays
    finite in fp32) and the result to [−10, 10], so one token with a huge ratio cannot dominate
    a batch mean. Shapes: [...] and [...] → [...].
    """
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy: `kl_k1` or
    `kl_k3` by name (`grpo.kl_estimator`); the token telemetry (keel.diagnostics.telemetry) uses
    the same two functions.
    Worked example: logp = log 0.5, ref = log 0.25 → k1 = 0.693147;
    k3 = 0.5 - (-0.693147) - 1 = 0.193147.
    """
    if kind == "k1":
        return kl_k1(logp, ref_logp)
    if kind == "k3":
        return kl_k3(logp, ref_logp)
    raise ValueError(f"grpo.kl_estimator: {kind!r} is not 'k1' or 'k3'")


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A), r = exp(logp - old_logp).

    All inputs [N] → (loss [N], clipped_low [N] bool, clipped_high [N] bool).
    `clipped_low` marks tokens where the lower bound is active (A < 0, r < 1 - clip_low) and
    `clipped_high` where the upper bound is active (A > 0, r > 1 + clip_high).
    Worked example, A = 1, r = 1.5, clip 0.2 → loss = -min(1.5, 1.2) = -1.2 (high clip active);
    A = -1, r = 0.5 → loss = -min(-0.5, -0.8) = 0.8 (low clip active).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    low = (advantages < 0) & (ratio < 1.0 - clip_low)
    high = (advantages > 0) & (ratio > 1.0 + clip_high)
    return loss, low, high


def aggregate(per_token: torch.Tensor, seq_index: torch.Tensor, mode: str, num_tokens: int, num_seqs: int, seq_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses [N] (sequence of each token: seq_index [N]) to a scalar.

    "token-mean": sum / num_tokens (num_tokens = policy tokens in the *whole* batch).
    "seq-mean-token-mean": Σ_seq (Σ_tokens / len_seq) / num_seqs; seq_lengths[s] is the full
    length of sequence s (which may span micro-batches), defaulting to its count here.
    Worked example: tokens [1, 2, 3] in seq 0 and [4] in seq 1 →
    token-mean = 10 / 4 = 2.5; seq-mean-token-mean = (6/3 + 4/1) / 2 = 3.0.
    """
    if mode == "token-mean":
        return per_token.sum() / max(num_tokens, 1)
    if mode == "seq-mean-token-mean":
        n_local = int(seq_index.max().item()) + 1 if seq_index.numel() else 0
        sums = torch.zeros(n_local, dtype=per_token.dtype, device=per_token.device).index_add(0, seq_index, per_token)
        if seq_lengths is None:
            seq_lengths = torch.zeros(n_local, device=per_token.device).index_add(0, seq_index, torch.ones_like(per_token))
        return (sums / seq_lengths.clamp(min=1)).sum() / max(num_seqs, 1)
    raise ValueError(f"grpo.loss_aggregation: {mode!r} is not 'token-mean' or 'seq-mean-token-mean'")


def sft_loss(logp: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Negative log-likelihood of target tokens, summed and divided by the batch's target count.

    Paper A's Eq. 3 is the summed token log-likelihood of each assistant turn; dividing the
    sum by the number of target tokens in the batch only rescales it, and makes the loss
    the same whether turns come as separate examples or packed in one sequence.
    """
    return -logp.sum() / max(num_tokens, 1)
