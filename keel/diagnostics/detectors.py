"""Detectors over the metric history: they say *that* a run is collapsing, while it runs.

Each detector watches the keys of `keel.metrics` for one signature from the papers: paper A's
KL spike on control tokens; paper B's post-peak cliff (EM 0.395 → 0 inside one 50-step eval
window), call-volume collapse (tools/question 3.0 → 1.0 in the same window), entropy collapse
(modes 1 and 3), format-drift onset (mode 3) and proxy gaming (reward up while EM is not).
The papers found these by looking at plots after the fact; the thresholds are Keel's and are
configurable (the `detectors:` section, DetectorConfig in keel.config). An alert fires once per
*episode* of a condition: a detector re-arms only after its condition has been false at one
update.

`Detectors.update(step, line)` takes one `metrics.jsonl` line; eval keys appear only on eval
steps, so eval-driven detectors advance only then. `state_dict()` is JSON-serialisable and
`load_state_dict` restores it exactly, so a resumed run raises the same alerts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from keel.config import DetectorConfig
from keel.metrics import (
    COLLAPSE_FORMAT_DRIFT,
    EVAL_ANSWERED,
    EVAL_EM,
    EVAL_TOOLS_PER_QUESTION,
    KL_CONTROL_SHARE,
    KL_TAG_PREFIX,
    LOSS_TRAINED_MEMBERS,
    REWARD_MEAN,
    ROLLOUT_TRUNCATED,
    TOKENS_ENTROPY,
    TOOLS_PER_QUESTION,
)

MAD_TO_SIGMA = 1.4826  # MAD × 1.4826 estimates σ for Gaussian noise


@dataclass
class Alert:
    """One alert: which detector (`kind`), at which step, the numbers behind it, what to do."""

    step: int
    kind: str
    evidence: dict[str, Any]
    suggested_action: str
    action: str = "warn"
    on_rollback: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SUGGESTIONS = {
    "kl_spike": "KL is concentrating on control tokens (paper A): add supervision (interleaved SFT, PRS) or raise the KL coefficient; inspect the top-KL tokens.",
    "cliff": "Dev EM fell off its peak (paper B mode 4): roll back to the peak checkpoint; raise KL x5 or gate r_retrv on >=2 distinct non-empty calls.",
    "call_volume": "Tool calls per question collapsed (paper B call-volume signature): check for quote-and-stop answers; roll back and gate or drop r_retrv.",
    "entropy": "Policy entropy collapsed: the output is converging on a low-entropy attractor (paper B modes 1 and 3); inspect samples, raise KL or stop.",
    "format_drift": "Tool tags are moving inside <think> (paper B mode 3): add a format term or raise KL x5.",
    "proxy_gaming": "Training reward rises while dev EM does not: the policy is optimising a proxy; inspect the reward components.",
}


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _slope_rise(points: list[list[float]]) -> float:
    """Least-squares slope × (last step − first step) of (step, value) points."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return slope * (xs[-1] - xs[0])


class Detectors:
    """Runs every enabled detector on each metrics line; see the module docstring.

    State (all JSON-serialisable): trailing series of (step, value) per watched key, the EM
    history for the cliff, the early entropy level, and the latched conditions.
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self.series: dict[str, list[list[float]]] = {}  # key -> [[step, value], ...], bounded
        self.latched: dict[str, bool] = {}  # condition key -> currently in an alerted episode
        self.early_entropy: list[float] = []

    # -- history ---------------------------------------------------------------------------------
    def _push(self, key: str, step: int, value: float, keep: int) -> list[list[float]]:
        seq = self.series.setdefault(key, [])
        seq.append([float(step), value])
        if len(seq) > keep:
            del seq[: len(seq) - keep]
        return seq

    def _fire(self, cond_key: str, condition: bool) -> bool:
        """True on the rising edge of a condition (once per episode of it)."""
        was = self.latched.get(cond_key, False)
        self.latched[cond_key] = condition
        return condition and not was

    def update(self, step: int, line: dict[str, Any]) -> list[Alert]:
        """Feed one metrics line (`{"step": .., "<prefix>/<name>": value, ...}`); return new alerts.
        Non-numeric and non-finite values are ignored."""
        values = {k: v for k, v in ((k, _number(v)) for k, v in line.items() if k != "step") if v is not None}
        alerts: list[Alert] = []
        c = self.config
        if c.kl_spike.enabled:
            alerts += self._kl_spike(step, values)
        if c.cliff.enabled and EVAL_EM in values:
            alerts += self._cliff(step, values)
        if c.call_volume.enabled:
            alerts += self._call_volume(step, values)
        # a step whose update trained no member measured no token: its logged entropy 0.0 is no level
        if c.entropy.enabled and TOKENS_ENTROPY in values and values.get(LOSS_TRAINED_MEMBERS) != 0:
            alerts += self._entropy(step, values[TOKENS_ENTROPY])
        if c.format_drift.enabled and COLLAPSE_FORMAT_DRIFT in values:
            alerts += self._format_drift(step, values[COLLAPSE_FORMAT_DRIFT])
        if c.proxy_gaming.enabled:
            alerts += self._proxy_gaming(step, values)
        return alerts

    def _alert(self, kind: str, step: int, evidence: dict[str, Any]) -> Alert:
        cfg = getattr(self.config, kind)
        return Alert(step, kind, evidence, SUGGESTIONS[kind], cfg.action, dict(cfg.on_rollback) if cfg.action == "rollback" else {})

    # -- detectors -------------------------------------------------------------------------------
    def _kl_spike(self, step: int, values: dict[str, float]) -> list[Alert]:
        cfg = self.config.kl_spike
        spikes = {}
        for key in sorted(k for k in values if k == KL_CONTROL_SHARE or k.startswith(KL_TAG_PREFIX)):
            x = values[key]
            history = [v for _, v in self.series.get(key, [])]
            condition, z, med = False, 0.0, 0.0
            if len(history) >= cfg.min_history:
                med = statistics.median(history)
                mad = statistics.median(abs(v - med) for v in history)
                scale = max(MAD_TO_SIGMA * mad, cfg.min_relative_scale * abs(med), 1e-12)
                z = (x - med) / scale
                condition = z >= cfg.z and x >= (cfg.min_control_share if key == KL_CONTROL_SHARE else cfg.min_tag_kl)
            if self._fire("kl_spike:" + key, condition):
                spikes[key] = {"value": x, "median": med, "robust_z": round(z, 2)}
            self._push(key, step, x, cfg.window)
        return [self._alert("kl_spike", step, {"series": spikes})] if spikes else []

    def _cliff(self, step: int, values: dict[str, float]) -> list[Alert]:
        cfg = self.config.cliff
        em = values[EVAL_EM]
        history = self.series.get(EVAL_EM, [])
        peak_step, peak = max(((s, v) for s, v in history), key=lambda sv: (sv[1], -sv[0]), default=(step, em))
        if em > peak:
            peak_step, peak = step, em
        recent = [v for _, v in history[-cfg.within_evals :]]
        below = peak >= cfg.min_peak and em <= peak - cfg.drop
        sudden = bool(recent) and max(recent) - em >= cfg.drop
        condition = below and (sudden or self.latched.get("cliff", False))
        out = []
        if self._fire("cliff", condition):
            evidence = {"eval/em": em, "peak": peak, "peak_step": int(peak_step), "previous": recent[-1] if recent else None}
            tools = self.series.get("cliff:" + EVAL_TOOLS_PER_QUESTION, [])
            if tools and EVAL_TOOLS_PER_QUESTION in values:  # the call-volume signature, if logged
                evidence["tools_per_question_before"] = tools[-1][1]
                evidence["tools_per_question_now"] = values[EVAL_TOOLS_PER_QUESTION]
            out.append(self._alert("cliff", step, evidence))
        if EVAL_TOOLS_PER_QUESTION in values:
            self._push("cliff:" + EVAL_TOOLS_PER_QUESTION, step, values[EVAL_TOOLS_PER_QUESTION], 1)
        # The whole EM history is kept for the running peak: one float pair per eval.
        self.series.setdefault(EVAL_EM, []).append([float(step), em])
        return out

    def _call_volume(self, step: int, values: dict[str, float]) -> list[Alert]:
        cfg = self.config.call_volume
        out = []
        for key, smooth, ended in ((EVAL_TOOLS_PER_QUESTION, 1, EVAL_ANSWERED), (TOOLS_PER_QUESTION, cfg.smooth, ROLLOUT_TRUNCATED)):
            if key not in values:
                continue
            raw = self._push("raw:" + key, step, values[key], smooth)
            # A level where most episodes never answered (they called until the turn limit) shows
            # the limit, not a volume the policy chose: it is compared, but kept as no reference.
            answered = 1.0  # an env or a log without the share: every level counts
            if ended in values:
                share = values[ended] if ended == EVAL_ANSWERED else 1.0 - values[ended]
                answered = statistics.median(v for _, v in self._push("answered:" + key, step, share, smooth))
            level = statistics.median(v for _, v in raw) if len(raw) >= smooth else None
            if level is None:
                continue
            levels = [p for p in self.series.get("level:" + key, []) if p[0] >= step - cfg.lookback_steps]
            reference = max((v for _, v in levels), default=0.0)
            condition = reference >= cfg.min_reference and level <= cfg.max_ratio * reference
            if self._fire("call_volume:" + key, condition):
                ref_step = next(s for s, v in levels if v == reference)
                out.append(self._alert("call_volume", step, {"series": key, "value": level, "reference": reference, "reference_step": int(ref_step), "ratio": level / reference}))
            self.series["level:" + key] = levels + ([[float(step), level]] if answered >= cfg.min_answered else [])
        return out

    def _entropy(self, step: int, x: float) -> list[Alert]:
        cfg = self.config.entropy
        if len(self.early_entropy) < cfg.early_steps:
            self.early_entropy.append(x)
        recent = self._push("raw:" + TOKENS_ENTROPY, step, x, cfg.smooth)
        if len(self.early_entropy) < cfg.early_steps or len(recent) < cfg.smooth:
            return []
        early = statistics.median(self.early_entropy)
        level = statistics.median(v for _, v in recent)
        condition = early > 0 and level < cfg.fraction * early
        if self._fire("entropy", condition):
            return [self._alert("entropy", step, {"tokens/entropy": level, "early_level": early, "ratio": level / early})]
        return []

    def _format_drift(self, step: int, x: float) -> list[Alert]:
        cfg = self.config.format_drift
        recent = self._push("raw:" + COLLAPSE_FORMAT_DRIFT, step, x, cfg.smooth)
        level = sum(v for _, v in recent) / len(recent)
        condition = len(recent) >= cfg.smooth and level > cfg.threshold
        if self._fire("format_drift", condition):
            return [self._alert("format_drift", step, {"collapse/format_drift": level, "threshold": cfg.threshold})]
        return []

    def _proxy_gaming(self, step: int, values: dict[str, float]) -> list[Alert]:
        cfg = self.config.proxy_gaming
        if REWARD_MEAN not in values and EVAL_EM not in values:
            return []
        start = step - cfg.window
        for key in (REWARD_MEAN, "proxy:" + EVAL_EM):
            name = key.split(":")[-1]
            if name in values:
                self.series.setdefault(key, []).append([float(step), values[name]])
            self.series[key] = [p for p in self.series.get(key, []) if p[0] >= start]
        rewards, ems = self.series[REWARD_MEAN], self.series["proxy:" + EVAL_EM]
        condition = False
        rise = gain = 0.0
        # Judge only with the window filled: the reward series must span most of it.
        if len(ems) >= 2 and len(rewards) >= 3 and rewards[-1][0] - rewards[0][0] >= 0.8 * cfg.window:
            rise = _slope_rise(rewards)
            gain = ems[-1][1] - ems[0][1]
            condition = rise >= cfg.min_reward_rise and gain <= cfg.max_em_gain
        if self._fire("proxy_gaming", condition):
            return [self._alert("proxy_gaming", step, {"reward_rise": round(rise, 4), "em_gain": round(gain, 4), "window": cfg.window})]
        return []

    # -- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "series": {k: [list(p) for p in v] for k, v in self.series.items()},
            "latched": dict(self.latched),
            "early_entropy": list(self.early_entropy),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.series = {str(k): [[float(s), float(v)] for s, v in seq] for k, seq in state["series"].items()}
            self.latched = {str(k): bool(v) for k, v in state["latched"].items()}
            self.early_entropy = [float(v) for v in state["early_entropy"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"Detectors.load_state_dict: malformed state ({type(exc).__name__}: {exc})") from None
