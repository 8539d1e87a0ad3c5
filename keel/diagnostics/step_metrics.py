"""The metrics line of one RL step, built in one place: every key has exactly one writer.

Writers of an RL line of metrics.jsonl (key families as in keel.metrics):
- `rl_step_metrics` (here): reward/, rollout/, loss/ (from the update's statistics), kl/ and
  tokens/ (token telemetry), tools/, collapse/, signal/, optim/lr, time/rollout_s, time/update_s
- the evaluation on eval steps: eval/; the detectors: alerts/; the step's end: time/step_s;
  the logger: step, time/wall_s, mem/peak_rss_mb

kl/k1_mean, kl/k3_mean, kl/mean and tokens/entropy come from the token telemetry only, over the
sampled tokens that entered the update (OPS gold members excluded), the same tokens as
kl/control_share, kl/text and kl/tag/*; `grpo_update` also returns these four over every token it
trained (gold ones included), and they do not enter the line. A step that trained no sampled
token writes 0.0 for these four (what an update that trains nothing reports) and no other kl/ key.
"""

from __future__ import annotations

from typing import Any

import torch

from keel import metrics as M
from keel.diagnostics.telemetry import ControlFrequencyBaseline
from keel.types import Source, Task, Trajectory

# what the token telemetry writes; `grpo_update`'s statistics of the same names stay out of the line
TELEMETRY_KEYS = (M.KL_K1_MEAN, M.KL_K3_MEAN, M.KL_MEAN, M.TOKENS_ENTROPY)


class PieceCache:
    """Decoded text of single token ids, cached (telemetry labels tokens by control tag)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        out = []
        for t in ids:
            p = self.cache.get(t)
            if p is None:
                p = self.tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                self.cache[t] = p
            out.append(p)
        return out


def token_telemetry_metrics(rows: list, pieces: PieceCache) -> dict[str, float]:
    """Control-tag KL telemetry of the trained tokens (keel.diagnostics.telemetry.token_telemetry).
    rows: (row index, token ids [T], policy log-probs [T], reference log-probs [T], entropy [T])
    per trained sampled row, as `grpo_update` appends them to its telemetry sink; sorted here by
    row index. No token measured: 0.0 for kl/k1_mean, kl/k3_mean, kl/mean and tokens/entropy."""
    out = dict.fromkeys(TELEMETRY_KEYS, 0.0)
    if not rows:
        return out
    from keel.chat import token_tag_labels
    from keel.diagnostics.telemetry import token_telemetry

    rows.sort(key=lambda x: x[0])
    tok_pieces = [pieces(ids) for _, ids, _, _, _ in rows]
    labels = [token_tag_labels(p) for p in tok_pieces]
    metrics, _top = token_telemetry([x[2] for x in rows], [x[3] for x in rows], [x[4] for x in rows], labels, tok_pieces)
    out.update(metrics)
    return out


def rl_step_metrics(trajs: list[Trajectory], rows: list[Task], groups: list[int], n_groups: int, update: dict[str, float],
                    signals: dict[str, float], telemetry_rows: list, pieces: PieceCache, freq_baseline: ControlFrequencyBaseline,
                    structural: bool, lr: float, t_rollout: float, t_update: float) -> dict[str, Any]:
    """The line of one RL step, before evaluation and detectors.

    trajs: every sampled row of the step (all ranks, row order), rewarded; rows: their tasks;
    groups: each row's group (0..n_groups-1); update: `grpo_update`'s statistics (reduced over
    ranks); signals: the signal/ keys of the step; telemetry_rows: see `token_telemetry_metrics`;
    structural: write collapse/ shares (they read <tool_call> blocks: only for the Hermes layout);
    `freq_baseline` records the first step's control-tag frequencies (the reference model's).
    """
    from keel.diagnostics.episode_metrics import episode_record, failure_metrics, tool_metrics
    from keel.diagnostics.states import structural_shares
    from keel.diagnostics.telemetry import control_tag_frequency

    comps: dict[str, list[float]] = {}
    for tr in trajs:
        for k, v in tr.reward_components.items():
            comps.setdefault(k, []).append(float(v))
    rewards = torch.tensor([tr.reward for tr in trajs])
    n_policy = sum(tr.num_policy_tokens for tr in trajs)
    mixed = sum(1 for k in range(n_groups) if rewards[[g == k for g in groups]].std() > 0) / n_groups
    line: dict[str, Any] = {
        M.PHASE: "rl",
        M.REWARD_MEAN: float(rewards.mean()),
        M.REWARD_STD: float(rewards.std()) if len(rewards) > 1 else 0.0,
        M.REWARD_MIXED_GROUPS: mixed,
        **{M.REWARD_COMPONENT_PREFIX + k: sum(v) / len(v) for k, v in comps.items()},
        **{k: v for k, v in update.items() if k not in TELEMETRY_KEYS},
        M.ROLLOUT_POLICY_TOKENS: float(n_policy),
        M.ROLLOUT_TOKENS_PER_S: n_policy / max(t_rollout, 1e-9),
        M.ROLLOUT_MEAN_TURNS: sum(len(tr.turn_spans) for tr in trajs) / len(trajs),
        M.ROLLOUT_TRUNCATED: sum(tr.truncated for tr in trajs) / len(trajs),
        M.TIME_ROLLOUT: t_rollout,
        M.TIME_UPDATE: t_update,
        M.OPTIM_LR: lr,
    }
    line.update(signals)
    line.update(token_telemetry_metrics(telemetry_rows, pieces))
    records = [episode_record(tr, task) for tr, task in zip(trajs, rows)]
    line.update(tool_metrics(records))
    line.update(failure_metrics(records))
    if structural:
        line.update(structural_shares(trajs))
    freqs = control_tag_frequency([pieces([t for t, s in zip(tr.token_ids, tr.sources) if s == Source.POLICY]) for tr in trajs])
    freq_baseline.record(freqs)  # first RL step: the policy equals the reference model
    line.update(freq_baseline.metrics(freqs))
    return line
