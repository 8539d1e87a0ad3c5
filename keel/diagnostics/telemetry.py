"""Token-level telemetry: per-token KL to the reference, split by control tag; entropy; tag counts.

Paper A saw the collapse as KL spikes concentrated on a few control tokens (`<tool_call>`,
`</tool_call>`, `<|im_end|>`) and in control-token frequency logs; these functions compute
those signals from the policy tokens of a batch. Keel departs in one way: a tag is located
in text (`keel.chat.token_tag_labels`), so a tag spread over several ordinary tokens (SmolLM2:
`</tool_call>` is 5 tokens) counts as that tag on each of its tokens, not only on one added
token as in Qwen2.5's vocabulary.

All functions are pure; tensors are 1-D per trajectory (T_i policy tokens) unless stated.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from keel.chat import CONTROL_TAGS, find_tag_spans
from keel.losses import kl_k1, kl_k3  # the one definition of each KL estimator
from keel.metrics import (
    KL_CONTROL_SHARE,
    KL_K1_MEAN,
    KL_K3_MEAN,
    KL_MEAN,
    KL_TAG_PREFIX,
    KL_TEXT,
    TOKENS_CONTROL_FREQ_MAX_RATIO,
    TOKENS_CONTROL_FREQ_PREFIX,
    TOKENS_CONTROL_FREQ_RATIO_PREFIX,
    TOKENS_CONTROL_FREQ_REF_PREFIX,
    TOKENS_ENTROPY,
    TOKENS_TAG_BALANCE,
)

TEXT_CLASS = "text"  # the class of tokens that are not part of a control tag


def token_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the softmax over the last dimension, per position. logits [..., V] → [...].

    Computed in chunks of `chunk_size` rows in fp32 under no_grad: a full [T, V] fp32
    log-softmax for 4k tokens of a 49k vocabulary is 800 MB; one chunk of 1024 rows is 200 MB.
    With z centred on its row maximum and e = exp(z): H = log Σe − Σ e·z / Σe, one exp pass and
    a fused dot product (25% faster on CPU than logsumexp plus softmax; 4096 × 49,152 fp32
    logits take ~4 s on 2 cores).
    """
    if logits.dim() == 0:
        raise ValueError("token_entropy: logits must have a vocabulary dimension, got a scalar")
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for i in range(0, flat.shape[0], chunk_size):
            z = flat[i : i + chunk_size].float()
            z = z - z.amax(dim=-1, keepdim=True)  # [chunk, V]
            z.clamp_(min=-1e4)  # masked (-inf) logits: exp gives 0 and 0·z stays 0 instead of NaN
            e = torch.exp(z)  # [chunk, V]
            total = e.sum(-1)  # [chunk]
            out[i : i + chunk_size] = torch.log(total) - torch.einsum("ij,ij->i", e, z) / total
    return out.reshape(logits.shape[:-1])


def kl_by_class(kl: torch.Tensor, labels: list[str | None], pieces: list[str] | None = None, top_k: int = 5) -> dict[str, Any]:
    """Aggregate a per-token KL by token class (each control tag, or ordinary text).

    kl: [N] per-token KL (k3 in Keel's metrics) over the N policy tokens of a batch, concatenated;
    labels: N entries, a tag name or None (= text); pieces: N token texts, for the top-k list.
    Returns {"tag_mean": {tag: mean KL on its tokens}, "text_mean": float, "control_share":
    Σ KL on tag tokens / Σ KL (0 when Σ KL = 0), "total": Σ KL, "n": N, "top": [...]} where "top"
    holds the `top_k` distinct token pieces with the largest summed KL, each
    {"piece", "total", "count", "mean", "tag"}, largest first (ties by piece text).

    Worked example: kl [1, 3, 0, 2], labels [None, "<tool_call>", None, "<tool_call>"]
    → tag_mean {"<tool_call>": 2.5}, text_mean 0.5, control_share 5/6.
    """
    n = kl.shape[0]
    if len(labels) != n or (pieces is not None and len(pieces) != n):
        raise ValueError(f"kl_by_class: {n} KL values but {len(labels)} labels and {None if pieces is None else len(pieces)} pieces")
    classes = [TEXT_CLASS] + sorted({lab for lab in labels if lab is not None})
    index = {c: i for i, c in enumerate(classes)}
    class_ids = torch.tensor([index[TEXT_CLASS if lab is None else lab] for lab in labels], dtype=torch.long)
    values = kl.detach().double().cpu()
    sums = torch.zeros(len(classes), dtype=torch.float64).index_add_(0, class_ids, values)
    counts = torch.bincount(class_ids, minlength=len(classes)).double()
    total = float(values.sum())
    control = total - float(sums[0])
    out: dict[str, Any] = {
        "tag_mean": {c: float(sums[i] / counts[i]) for c, i in index.items() if c != TEXT_CLASS and counts[i] > 0},
        "text_mean": float(sums[0] / counts[0]) if counts[0] > 0 else 0.0,
        "control_share": control / total if total > 0 else 0.0,
        "total": total,
        "n": n,
        "top": [],
    }
    if pieces is not None and top_k > 0 and n > 0:
        distinct: dict[str, int] = {}
        piece_ids = torch.tensor([distinct.setdefault(p, len(distinct)) for p in pieces], dtype=torch.long)
        p_sums = torch.zeros(len(distinct), dtype=torch.float64).index_add_(0, piece_ids, values)
        p_counts = torch.bincount(piece_ids, minlength=len(distinct))
        first_label: dict[int, str | None] = {}
        for pid, lab in zip(piece_ids.tolist(), labels):
            first_label.setdefault(pid, lab)
        names = list(distinct)
        order = sorted(range(len(names)), key=lambda i: (-float(p_sums[i]), names[i]))[:top_k]
        out["top"] = [
            {"piece": names[i], "total": float(p_sums[i]), "count": int(p_counts[i]), "mean": float(p_sums[i]) / int(p_counts[i]), "tag": first_label[i]}
            for i in order
        ]
    return out


def tag_counts(pieces: list[str], tags: tuple[str, ...] = CONTROL_TAGS) -> Counter:
    """Occurrences of each control tag in a token sequence given as per-token texts."""
    return Counter(span.tag for span in find_tag_spans(pieces, tags))


def control_tag_frequency(pieces_per_traj: list[list[str]], tags: tuple[str, ...] = CONTROL_TAGS) -> dict[str, float]:
    """Occurrences of each tag in the policy tokens, per trajectory: {tag: Σ count / #trajectories}.
    Every tag in `tags` is present (0.0 when unseen), so baselines and ratios align."""
    total: Counter = Counter()
    for pieces in pieces_per_traj:
        total.update(tag_counts(pieces, tags))
    n = max(len(pieces_per_traj), 1)
    return {tag: total[tag] / n for tag in tags}


def tool_call_tag_balance(pieces_per_traj: list[list[str]]) -> float:
    """Mean over trajectories of |#<tool_call> − #</tool_call>| / (#<tool_call> + #</tool_call>),
    a trajectory without either tag counting 0. Per trajectory, so that one trajectory's extra
    opening tag is not cancelled by another's extra closing tag."""
    if not pieces_per_traj:
        return 0.0
    out = 0.0
    for pieces in pieces_per_traj:
        c = tag_counts(pieces, ("<tool_call>", "</tool_call>"))
        both = c["<tool_call>"] + c["</tool_call>"]
        out += abs(c["<tool_call>"] - c["</tool_call>"]) / both if both else 0.0
    return out / len(pieces_per_traj)


class ControlFrequencyBaseline:
    """The reference model's control-tag frequencies and the policy's ratio to them.

    In GRPO the step-0 policy is the reference model, so the trainer records the baseline from
    the step-0 rollouts (`record`, once) and asks for `metrics(freqs)` at every later step.
    Ratios use a pseudo-count of 0.1 occurrences per trajectory on both sides,
    (f + 0.1) / (b + 0.1), so a tag the reference never wrote gives a finite ratio (a tag that
    appears once per trajectory from nowhere reads 11×) instead of infinity in metrics.jsonl.
    """

    PSEUDO_COUNT = 0.1

    def __init__(self) -> None:
        self.baseline: dict[str, float] | None = None

    def record(self, freqs: dict[str, float]) -> None:
        """Store the baseline frequencies; only the first call counts."""
        if self.baseline is None:
            self.baseline = dict(freqs)

    def metrics(self, freqs: dict[str, float]) -> dict[str, float]:
        """`tokens/freq_ref/<tag>`, `tokens/freq_ratio/<tag>` and the largest ratio; {} before a baseline."""
        if self.baseline is None:
            return {}
        out: dict[str, float] = {}
        ratios = []
        for tag, base in self.baseline.items():
            ratio = (freqs.get(tag, 0.0) + self.PSEUDO_COUNT) / (base + self.PSEUDO_COUNT)
            out[TOKENS_CONTROL_FREQ_REF_PREFIX + tag] = base
            out[TOKENS_CONTROL_FREQ_RATIO_PREFIX + tag] = ratio
            ratios.append(ratio)
        if ratios:
            out[TOKENS_CONTROL_FREQ_MAX_RATIO] = max(ratios)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": None if self.baseline is None else dict(self.baseline)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        base = state.get("baseline")
        if base is not None and not isinstance(base, dict):
            raise ValueError(f"ControlFrequencyBaseline.load_state_dict: 'baseline' must be a dict or None, got {type(base).__name__}")
        self.baseline = None if base is None else {str(k): float(v) for k, v in base.items()}


def token_telemetry(
    policy_logps: list[torch.Tensor],
    ref_logps: list[torch.Tensor],
    entropies: list[torch.Tensor] | None,
    labels: list[list[str | None]],
    pieces: list[list[str]],
    top_k: int = 5,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """All token metrics of one batch, over the POLICY tokens of each trajectory.

    Per trajectory i: policy_logps[i], ref_logps[i], entropies[i] are [T_i]; labels[i] and
    pieces[i] have T_i entries (`keel.chat.token_tag_labels` of the pieces). `entropies` may be
    None (no `tokens/entropy`). Means are over all policy tokens of the batch (token-weighted).
    Returns (metrics keyed by keel.metrics names, the top-k KL tokens of `kl_by_class`).
    """
    n = len(policy_logps)
    for name, seq in (("ref_logps", ref_logps), ("labels", labels), ("pieces", pieces)) + ((("entropies", entropies),) if entropies is not None else ()):
        if len(seq) != n:
            raise ValueError(f"token_telemetry: {n} trajectories in policy_logps but {len(seq)} in {name}")
    for i in range(n):
        t = policy_logps[i].shape[0]
        lens = {"ref_logps": ref_logps[i].shape[0], "labels": len(labels[i]), "pieces": len(pieces[i])}
        if entropies is not None:
            lens["entropies"] = entropies[i].shape[0]
        bad = {k: v for k, v in lens.items() if v != t}
        if bad:
            raise ValueError(f"token_telemetry: trajectory {i} has {t} policy log-probs but lengths {bad}")
    metrics: dict[str, float] = {}
    top: list[dict[str, Any]] = []
    if n and sum(p.shape[0] for p in policy_logps):
        logp = torch.cat([p.detach().float().cpu() for p in policy_logps])
        ref = torch.cat([p.detach().float().cpu() for p in ref_logps])
        k3 = kl_k3(logp, ref)
        flat_labels = [lab for seq in labels for lab in seq]
        flat_pieces = [p for seq in pieces for p in seq]
        agg = kl_by_class(k3, flat_labels, flat_pieces, top_k)
        metrics[KL_K1_MEAN] = float(kl_k1(logp, ref).mean())
        metrics[KL_K3_MEAN] = metrics[KL_MEAN] = float(k3.mean())
        metrics[KL_CONTROL_SHARE] = agg["control_share"]
        metrics[KL_TEXT] = agg["text_mean"]
        for tag, v in agg["tag_mean"].items():
            metrics[KL_TAG_PREFIX + tag] = v
        if entropies is not None:
            metrics[TOKENS_ENTROPY] = float(torch.cat([e.detach().float().cpu() for e in entropies]).mean())
        top = agg["top"]
    for tag, f in control_tag_frequency(pieces).items():
        metrics[TOKENS_CONTROL_FREQ_PREFIX + tag] = f
    metrics[TOKENS_TAG_BALANCE] = tool_call_tag_balance(pieces)
    return metrics, top
