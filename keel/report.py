"""One self-contained `report.html` per run: curves, KL by token class, structural states,
the failure-mode verdict and a trajectory viewer with tokens coloured by source.

Paper A reads collapse off per-token KL concentrated on control tags and off control-token
frequency logs; paper B reads it off dev EM / CvT / tools-per-question around a peak. This page
puts those views side by side for one run directory. Departures: plots are inline SVG drawn
here (no plotting library, no network), and a Content-Security-Policy forbids every fetch and
every script except the one inline script below, so model text that slipped past escaping
still could not run.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from keel import metrics
from keel.chat import CONTROL_TAGS, token_tag_labels
from keel.diagnostics.episode_metrics import eval_metrics
from keel.rundir import atomic_write_text, read_jsonl, read_run

# ----------------------------------------------------------------------------------------------
# Reading a run directory
# ----------------------------------------------------------------------------------------------

def _number(value: Any) -> float | None:
    """A finite float, or None for strings, bools-as-text, NaN and inf."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def metric_series(rows: Iterable[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] sorted by step; for a step logged twice the later line wins
    (a resumed run re-logs the steps after its last checkpoint). Non-finite values are dropped.

    Worked example: rows [{"step": 2, "a": 1}, {"step": 1, "a": 5}, {"step": 2, "a": 3}]
    → {"a": [(1, 5.0), (2, 3.0)]}.
    """
    by_key: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row.get(metrics.STEP)
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        for key, value in row.items():
            if key in (metrics.STEP, metrics.PHASE):
                continue
            number = _number(value)
            if number is not None:
                by_key.setdefault(key, {})[step] = number
    return {k: sorted(v.items()) for k, v in by_key.items()}


def rl_steps(rows: Iterable[dict[str, Any]]) -> dict[int, int | None]:
    """step -> RL steps done by then, for every logged step; None for a step written by an SFT
    line (the warm-start or an interleaved supervision phase), which has no place on an RL-step
    axis. The x positions that line runs with supervision phases up against runs without. A step
    logged twice keeps its later line, as in `metric_series`.

    Worked example: phases 0 eval, 1 rl, 2 rl, 3 sft, 4 sft, 5 rl
    → {0: 0, 1: 1, 2: 2, 3: None, 4: None, 5: 3}.
    """
    phase_of: dict[int, Any] = {}
    for row in rows:
        step = row.get(metrics.STEP)
        if isinstance(step, int) and not isinstance(step, bool):
            phase_of[step] = row.get(metrics.PHASE)
    out: dict[int, int | None] = {}
    done = 0
    for step in sorted(phase_of):
        if phase_of[step] == "rl":
            done += 1
        out[step] = None if phase_of[step] == "sft" else done
    return out


@dataclass
class Run:
    """Everything the report reads from one run directory; absent parts stay empty."""

    directory: Path
    name: str
    config_text: str = ""
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: dict[str, Any] | None = None
    samples: dict[int, Path] = field(default_factory=dict)
    evals: dict[int, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rl_step: dict[int, int | None] = field(default_factory=dict)  # step -> RL steps done, None for SFT steps (`rl_steps`)

    @property
    def steps(self) -> tuple[int, int] | None:
        """(first, last) step seen in any metric."""
        all_steps = [s for pts in self.series.values() for s, _ in pts]
        return (min(all_steps), max(all_steps)) if all_steps else None


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read a run directory (keel.rundir.read_run, plus config.yaml and diagnosis.json). Raises
    only if the directory itself does not exist."""
    directory = Path(run_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"run directory {directory} does not exist or is not a directory")
    run = Run(directory=directory, name=directory.resolve().name)
    config = directory / "config.yaml"
    if config.is_file():
        run.config_text = config.read_text(encoding="utf-8", errors="replace")
    files = read_run(directory)
    run.series = metric_series(files.metrics)
    run.rl_step = rl_steps(files.metrics)
    run.problems += files.problems["metrics.jsonl"]
    run.alerts = [r for r in files.alerts if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)]
    run.problems += files.problems["alerts.jsonl"]
    if len(files.alerts) > len(run.alerts):
        run.problems.append(f"alerts.jsonl: {len(files.alerts) - len(run.alerts)} alert(s) without an integer step, skipped")
    diagnosis_path = directory / "diagnosis.json"
    if diagnosis_path.is_file():
        try:
            loaded = json.loads(diagnosis_path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                run.diagnosis = loaded
            else:
                run.problems.append("diagnosis.json: not a JSON object, ignored")
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            run.problems.append(f"diagnosis.json: not JSON ({type(exc).__name__}), ignored")
    run.samples, run.evals = files.samples, files.evals
    # Eval steps whose means never reached metrics.jsonl (a crash between the eval and the log
    # line) are recomputed from the per-question files, so the curves have every eval point.
    for step, path in run.evals.items():
        rows, _ = read_jsonl(path)
        for key, value in eval_metrics(rows).items():
            points = dict(run.series.get(key, []))
            if step not in points:
                points[step] = value
                run.series[key] = sorted(points.items())
    return run


# ----------------------------------------------------------------------------------------------
# SVG primitives (return markup; every text that reaches the page goes through escape)
# ----------------------------------------------------------------------------------------------


def escape(value: Any) -> str:
    """HTML-escape anything (quotes too, so the result is safe inside attributes)."""
    return html.escape(str(value), quote=True)


def format_number(value: float | None) -> str:
    """Short human number: 0.412, 12.3, 4,096; '–' for None."""
    if value is None:
        return "–"
    a = abs(value)
    if a == 0:
        return "0"
    if value == int(value) and a < 1e6:  # steps, counts, 0/1 outcomes
        return f"{int(value):,}"
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 10:
        return f"{value:.1f}"
    if a >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2e}"


PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#a16207", "#db2777", "#4b5563", "#65a30d")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: nice_ticks(0, 1) → [0, 0.2, 0.4, 0.6, 0.8, 1]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if raw <= m * magnitude * (1 + 1e-9))
    ticks = []
    t = math.ceil(low / step - 1e-9) * step
    while t <= high + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


MAX_POINTS = 1200  # per drawn series; a 50k-step run would otherwise make a 5 MB page


def thin(points: list[tuple[float, float]], max_points: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most `max_points` points: consecutive buckets keep their lowest and highest point (in
    step order), so a one-step KL spike survives where every-k-th sampling would drop it.

    Worked example, max_points 4: [(1,0),(2,9),(3,1),(4,2),(5,0),(6,3)] → buckets of 3:
    [(1,0),(2,9)] + [(5,0),(6,3)].
    """
    if len(points) <= max_points:
        return points
    size = math.ceil(len(points) / (max_points // 2))
    kept: list[tuple[float, float]] = []
    for i in range(0, len(points), size):
        bucket = points[i : i + size]
        low = min(range(len(bucket)), key=lambda k: bucket[k][1])
        high = max(range(len(bucket)), key=lambda k: bucket[k][1])
        kept += [bucket[k] for k in sorted({low, high})]
    return kept


@dataclass
class Line:
    name: str
    points: list[tuple[float, float]]
    colour: str
    dashed: bool = False
    dots: bool = False  # a circle with a tooltip at every point (sparse series such as evals)


@dataclass
class Marker:
    """A vertical line at a step (an alert)."""

    x: float
    label: str


def _legend(lines: list[tuple[str, str, bool]]) -> str:
    items = "".join(
        f'<span class="key"><svg width="18" height="8"><line x1="0" y1="4" x2="18" y2="4" stroke="{escape(c)}" stroke-width="2"'
        f'{" stroke-dasharray=&quot;4 3&quot;" if dashed else ""}/></svg>{escape(n)}</span>'
        for n, c, dashed in lines
    )
    return f'<figcaption>{items}</figcaption>'


def line_chart(
    title: str,
    lines: list[Line],
    *,
    markers: Iterable[Marker] = (),
    peak: tuple[float, float, str] | None = None,
    x_range: tuple[float, float] | None = None,
    y_range: tuple[float | None, float | None] = (None, None),
    width: int = 440,
    height: int = 220,
) -> str:
    """A line chart as an inline <svg> inside a <figure>, or a one-line note without data.

    `y_range` pins either end (None = from the data). Markers outside the x range are dropped.
    """
    lines = [series for series in lines if series.points]
    if not lines:
        return f'<p class="note">{escape(title)}: no data yet.</p>'
    xs = [x for series in lines for x, _ in series.points]
    ys = [y for series in lines for _, y in series.points]
    x_low, x_high = x_range if x_range else (min(xs), max(xs))
    if x_high <= x_low:
        x_low, x_high = x_low - 1, x_high + 1
    y_low = y_range[0] if y_range[0] is not None else min(ys)
    y_high = y_range[1] if y_range[1] is not None else max(ys)
    if y_high <= y_low:
        pad = abs(y_low) * 0.1 or 1.0
        y_low, y_high = y_low - pad, y_high + pad
    y_ticks = nice_ticks(y_low, y_high, 4)
    y_low, y_high = min(y_low, y_ticks[0]), max(y_high, y_ticks[-1])
    left, right, top, bottom = 52, 12, 22, 30
    plot_w, plot_h = width - left - right, height - top - bottom

    def to_x(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * plot_w

    def to_y(y: float) -> float:
        return top + (y_high - y) / (y_high - y_low) * plot_h

    out = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    out.append(f'<text x="{left}" y="14" class="title">{escape(title)}</text>')
    for t in y_ticks:
        y = to_y(t)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{left - 4}" y="{y + 3:.1f}" class="tick" text-anchor="end">{escape(format_number(t))}</text>')
    for t in nice_ticks(x_low, x_high, 5):
        x = to_x(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" class="axis"/>')
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 15}" class="tick" text-anchor="middle">{escape(format_number(t))}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    by_step: dict[float, list[str]] = {}
    for m in markers:
        if x_low <= m.x <= x_high:
            by_step.setdefault(m.x, []).append(m.label)
    for x_value, labels in sorted(by_step.items()):
        x = to_x(x_value)
        tip = escape(f"step {x_value:g}: " + "; ".join(labels))
        out.append(
            f'<g class="alert"><title>{tip}</title><line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_h}"/>'
            f'<path d="M{x - 4:.1f},{top - 6} L{x + 4:.1f},{top - 6} L{x:.1f},{top} Z"/></g>'
        )
    for series in lines:
        path = " ".join(f"{'M' if i == 0 else 'L'}{to_x(x):.1f},{to_y(y):.1f}" for i, (x, y) in enumerate(thin(series.points)))
        dash = ' stroke-dasharray="5 3"' if series.dashed else ""
        out.append(f'<path d="{path}" fill="none" stroke="{escape(series.colour)}" stroke-width="1.6"{dash}><title>{escape(series.name)}</title></path>')
        if series.dots:
            for x, y in series.points:
                out.append(
                    f'<circle cx="{to_x(x):.1f}" cy="{to_y(y):.1f}" r="2.6" fill="{escape(series.colour)}">'
                    f"<title>{escape(f'{series.name} @ step {x:g}: {format_number(y)}')}</title></circle>"
                )
    if peak is not None:
        x, y, label = peak
        out.append(
            f'<g class="peak"><circle cx="{to_x(x):.1f}" cy="{to_y(y):.1f}" r="5"/>'
            f'<text x="{to_x(x) + (-6 if to_x(x) > left + plot_w * 0.7 else 6):.1f}" y="{max(to_y(y) - 7, top + 9):.1f}" '
            f'text-anchor="{"end" if to_x(x) > left + plot_w * 0.7 else "start"}">{escape(label)}</text></g>'
        )
    out.append("</svg>")
    legend = _legend([(series.name, series.colour, series.dashed) for series in lines])
    return f'<figure>{"".join(out)}{legend}</figure>'


def stacked_area_chart(title: str, layers: list[tuple[str, str, list[tuple[int, float]]]], *, width: int = 440, height: int = 220) -> str:
    """Shares stacked from 0 to 1 per step (structural states). Steps where any layer is
    missing are left out rather than drawn as zero."""
    present = [(n, c, dict(p)) for n, c, p in layers if p]
    if not present:
        return f'<p class="note">{escape(title)}: no data yet.</p>'
    steps = sorted(set.intersection(*(set(d) for _, _, d in present)))
    if not steps:
        return f'<p class="note">{escape(title)}: the states were never logged at the same step.</p>'
    left, right, top, bottom = 52, 12, 22, 30
    plot_w, plot_h = width - left - right, height - top - bottom
    x_low, x_high = steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1
    total_high = max(1.0, max(sum(d[s] for _, _, d in present) for s in steps))

    def to_x(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * plot_w

    def to_y(y: float) -> float:
        return top + (total_high - y) / total_high * plot_h

    out = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    out.append(f'<text x="{left}" y="14" class="title">{escape(title)}</text>')
    for t in nice_ticks(0, total_high, 4):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{to_y(t):.1f}" y2="{to_y(t):.1f}" class="grid"/>')
        out.append(f'<text x="{left - 4}" y="{to_y(t) + 3:.1f}" class="tick" text-anchor="end">{escape(format_number(t))}</text>')
    for t in nice_ticks(x_low, x_high, 5):
        out.append(f'<text x="{to_x(t):.1f}" y="{top + plot_h + 15}" class="tick" text-anchor="middle">{escape(format_number(t))}</text>')
    below = {s: 0.0 for s in steps}
    for name, colour, values in present:
        above = {s: below[s] + values[s] for s in steps}
        if len(steps) == 1:  # one step: a full-width band
            s = steps[0]
            upper = [(left, to_y(above[s])), (left + plot_w, to_y(above[s]))]
            lower = [(left + plot_w, to_y(below[s])), (left, to_y(below[s]))]
        else:
            upper = [(to_x(s), to_y(above[s])) for s in steps]
            lower = [(to_x(s), to_y(below[s])) for s in reversed(steps)]
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in upper + lower)
        last = steps[-1]
        out.append(f'<polygon points="{points}" fill="{escape(colour)}" opacity="0.85"><title>{escape(f"{name}: {format_number(values[last])} at step {last}")}</title></polygon>')
        below = above
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    out.append("</svg>")
    return f'<figure>{"".join(out)}{_legend([(n, c, False) for n, c, _ in present])}</figure>'


HEAT_STOPS = ((0.0, (255, 255, 255)), (0.35, (254, 217, 118)), (0.7, (240, 59, 32)), (1.0, (84, 0, 60)))


def heat_colour(t: float) -> str:
    """t in [0, 1] → white, yellow, red, dark purple."""
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(HEAT_STOPS, HEAT_STOPS[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(c0, c1))
    return "#54003c"


def heatmap(title: str, rows: list[tuple[str, list[tuple[int, float]]]], *, max_columns: int = 120, width: int = 920) -> str:
    """Rows × steps heatmap on a log colour scale (KL spikes span orders of magnitude).

    More than `max_columns` steps are averaged into that many equal runs of consecutive steps.
    The scale runs from max/1e4 (or the smallest positive value, if larger) to the max.
    """
    rows = [(name, points) for name, points in rows if points]
    if not rows:
        return f'<p class="note">{escape(title)}: no data yet.</p>'
    steps = sorted({s for _, pts in rows for s, _ in pts})
    group = max(1, math.ceil(len(steps) / max_columns))
    columns = [steps[i : i + group] for i in range(0, len(steps), group)]
    grid: list[list[float | None]] = []
    for _, points in rows:
        lookup = dict(points)
        cells = []
        for col in columns:
            values = [lookup[s] for s in col if s in lookup]
            cells.append(sum(values) / len(values) if values else None)
        grid.append(cells)
    positive = [v for r in grid for v in r if v is not None and v > 0]
    high = max(positive) if positive else 1.0
    low = max(min(positive), high / 1e4) if positive else high / 10
    if low >= high:
        low = high / 10

    def scale(v: float) -> float:
        return 0.0 if v <= 0 else (math.log10(max(v, low)) - math.log10(low)) / (math.log10(high) - math.log10(low))

    label_w, cell_h, top = 150, 16, 22
    cell_w = (width - label_w - 24) / len(columns)
    height = top + cell_h * len(rows) + 44
    out = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    out.append(f'<text x="4" y="14" class="title">{escape(title)}</text>')
    for r, ((name, _), cells) in enumerate(zip(rows, grid)):
        y = top + r * cell_h
        out.append(f'<text x="{label_w - 6}" y="{y + cell_h - 4}" class="tick" text-anchor="end">{escape(name)}</text>')
        for c, value in enumerate(cells):
            x = label_w + c * cell_w
            col = columns[c]
            span = f"step {col[0]}" if len(col) == 1 else f"steps {col[0]}–{col[-1]}"
            fill = "#f3f4f6" if value is None else heat_colour(scale(value))
            tip = f"{name}, {span}: {'not logged' if value is None else format_number(value)}"
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{cell_w + 0.3:.1f}" height="{cell_h - 1}" fill="{fill}"><title>{escape(tip)}</title></rect>')
    base = top + cell_h * len(rows)
    for t in nice_ticks(steps[0], steps[-1], 6) if len(steps) > 1 else [steps[0]]:
        index = min(range(len(columns)), key=lambda c: abs(columns[c][0] - t))
        x = label_w + (index + 0.5) * cell_w
        out.append(f'<text x="{x:.1f}" y="{base + 12}" class="tick" text-anchor="middle">{escape(format_number(t))}</text>')
    bar_x, bar_y = label_w, base + 22
    for i in range(50):
        out.append(f'<rect x="{bar_x + i * 4}" y="{bar_y}" width="4.3" height="8" fill="{heat_colour(i / 49)}"/>')
    out.append(f'<text x="{bar_x - 6}" y="{bar_y + 8}" class="tick" text-anchor="end">{escape(format_number(low))}</text>')
    out.append(f'<text x="{bar_x + 206}" y="{bar_y + 8}" class="tick">{escape(format_number(high))} (log scale)</text>')
    out.append("</svg>")
    return f'<figure>{"".join(out)}</figure>'


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------

SOURCE_NAMES = {0: "prompt", 1: "policy", 2: "tool", 3: "hint", 4: "expert", 5: "reflection"}
STATE_LAYERS = (
    (metrics.COLLAPSE_HEALTHY_CALL, "healthy tool call", "#16a34a"),
    (metrics.COLLAPSE_HEALTHY_RESPONSE, "healthy response", "#60a5fa"),
    (metrics.COLLAPSE_TEXT_POLLUTION, "text pollution", "#f59e0b"),
    (metrics.COLLAPSE_FULL, "full collapse", "#b91c1c"),
)
EVAL_SHARES = ((metrics.EVAL_EM, "EM"), (metrics.EVAL_F1, "F1"), (metrics.EVAL_CVT, "CvT"), (metrics.EVAL_FORMAT_VALID, "format valid"))
MAX_SAMPLE_FILES = 4  # the latest sample files shown; older ones are listed by name only
MAX_TRAJECTORIES = 8  # per sample file
MAX_TOKENS = 4000  # per trajectory after the prompt; a longer one is cut with a note
MAX_TEXT = 4000  # characters of one tool observation or turn text
MAX_EVAL_ROWS = 60
# Per-question fields shown, in this order, when present (keel.diagnostics.episode_metrics.episode_record).
EVAL_COLUMNS = ("task_id", "answer", "em", "f1", "cvt", "format_valid", "answered", "tools", "valid_calls", "empty_results", "distinct_nonempty", "verbs", "errors", "truncated")


def _alert_markers(run: Run) -> list[Marker]:
    return [Marker(float(a["step"]), f'{a.get("kind", "alert")}' + (f' → {a["suggested_action"]}' if a.get("suggested_action") else "")) for a in run.alerts]


def _x_range(run: Run) -> tuple[float, float] | None:
    steps = run.steps
    return (float(steps[0]), float(steps[1])) if steps else None


def peak_of(points: list[tuple[int, float]]) -> tuple[int, float] | None:
    """The first step at which the series reaches its maximum."""
    if not points:
        return None
    best = max(v for _, v in points)
    return next((s, v) for s, v in points if v == best)


def section_summary(run: Run) -> str:
    em = run.series.get(metrics.EVAL_EM, [])
    peak = peak_of(em)
    cards = [
        ("steps logged", f"{run.steps[0]}–{run.steps[1]}" if run.steps else "none"),
        ("last dev EM", format_number(em[-1][1]) + f" @ {em[-1][0]}" if em else "no eval yet"),
        ("peak dev EM", format_number(peak[1]) + f" @ {peak[0]}" if peak else "no eval yet"),
        ("alerts", str(len(run.alerts))),
        ("verdict", str(run.diagnosis.get("mode", "?")) if run.diagnosis else "no diagnosis"),
    ]
    return '<div class="cards">' + "".join(f'<div class="card"><div class="label">{escape(k)}</div><div class="value">{escape(v)}</div></div>' for k, v in cards) + "</div>"


def _json_cell(value: Any) -> str:
    """One value as cell content: text as text, yes/no as ✓/✗, numbers short, the rest as JSON."""
    if isinstance(value, str):
        return f"<pre>{escape(_clip(value, 600))}</pre>" if "\n" in value else escape(_clip(value, 600))
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "✓" if value else "✗"
    if isinstance(value, (int, float)):
        return escape(format_number(value) if math.isfinite(value) else str(value))
    return f"<code>{escape(_clip(json.dumps(value, ensure_ascii=False, default=str), 600))}</code>"


def _nested_table(value: Any) -> str:
    """A list of objects (signals, examples) or an object of objects (scores per mode) as a
    small table with the union of their keys as columns; anything else as one cell."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keyed = [("", v) for v in value]
    elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        keyed = [(k, v) for k, v in value.items()]
    else:
        return _json_cell(value)
    columns: list[str] = []
    for _, row in keyed:
        columns += [c for c in row if c not in columns]
    first = "<th></th>" if isinstance(value, dict) else ""
    head = first + "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + (f"<td>{escape(k)}</td>" if isinstance(value, dict) else "") + "".join(f"<td>{_json_cell(row.get(c))}</td>" for c in columns) + "</tr>"
        for k, row in keyed
    )
    return f'<table class="small"><tr>{head}</tr>{body}</table>'


def section_verdict(run: Run) -> str:
    parts = ["<h2>Verdict</h2>"]
    d = run.diagnosis
    if not d:
        parts.append('<p class="note">No diagnosis.json in this run yet (the diagnosis is written by the detectors or by <code>keel diagnose</code>).</p>')
    else:
        confidence = _number(d.get("confidence"))
        parts.append(f'<p class="verdict">Failure mode: <b>{escape(d.get("mode", "unknown"))}</b>' + (f" (confidence {format_number(confidence)})" if confidence is not None else "") + "</p>")
        evidence = d.get("evidence")
        if isinstance(evidence, dict) and evidence:
            parts.append("<table><tr><th>evidence</th><th>value</th></tr>" + "".join(f"<tr><td>{escape(k)}</td><td>{_nested_table(v)}</td></tr>" for k, v in evidence.items()) + "</table>")
        elif isinstance(evidence, list) and evidence:
            parts.append(_nested_table(evidence))
        elif evidence:
            parts.append(f"<p>{_json_cell(evidence)}</p>")
    parts.append("<h3>Alerts</h3>")
    if not run.alerts:
        parts.append('<p class="note">No alerts raised.</p>')
    else:
        head = "<tr><th>step</th><th>kind</th><th>evidence</th><th>suggested action</th><th>action taken</th></tr>"
        body = "".join(
            f'<tr><td>{escape(a["step"])}</td><td>{escape(a.get("kind", ""))}</td><td>{_json_cell(a.get("evidence", {}))}</td>'
            f'<td>{_json_cell(a.get("suggested_action", ""))}</td><td>{_json_cell(a.get("action", ""))}</td></tr>'
            for a in sorted(run.alerts, key=lambda a: a["step"])
        )
        parts.append(f"<table>{head}{body}</table>")
    return "".join(parts)


def section_eval(run: Run) -> str:
    markers, x_range = _alert_markers(run), _x_range(run)
    em = run.series.get(metrics.EVAL_EM, [])
    if not em and not any(run.series.get(k) for k, _ in EVAL_SHARES):
        return '<h2>Dev evaluation</h2><p class="note">No evaluation yet: the curves appear after the first eval step.</p>'
    peak = peak_of(em)
    lines = [Line(label, run.series.get(key, []), PALETTE[i], dots=True) for i, (key, label) in enumerate(EVAL_SHARES)]
    shares = line_chart(
        "EM, F1, CvT, format validity (dev, greedy)", lines, markers=markers, x_range=x_range, y_range=(0.0, None),
        peak=(peak[0], peak[1], f"peak EM {format_number(peak[1])} @ {peak[0]}") if peak else None, width=560,
    )
    tools = line_chart(
        "tools per question (dev)", [Line("tools/question", run.series.get(metrics.EVAL_TOOLS_PER_QUESTION, []), PALETTE[4], dots=True)],
        markers=markers, x_range=x_range, y_range=(0.0, None), width=360,
    )
    note = ""
    if peak and em[-1][1] < peak[1]:
        note = f'<p class="note">Last EM {format_number(em[-1][1])} at step {em[-1][0]} is {format_number(peak[1] - em[-1][1])} below the peak ({format_number(peak[1])} at step {peak[0]}).</p>'
    return f'<h2>Dev evaluation</h2><div class="row">{shares}{tools}</div>{note}'


def section_reward(run: Run) -> str:
    markers, x_range = _alert_markers(run), _x_range(run)
    skip = {metrics.REWARD_MEAN, metrics.REWARD_STD, metrics.REWARD_MIXED_GROUPS}
    components = sorted(k for k in run.series if k.startswith(metrics.REWARD_COMPONENT_PREFIX) and k not in skip)
    lines = [Line("reward/mean", run.series.get(metrics.REWARD_MEAN, []), "#111827")]
    lines += [Line(k, run.series[k], PALETTE[i % len(PALETTE)], dashed=True) for i, k in enumerate(components)]
    reward = line_chart("reward and its components (training batch)", lines, markers=markers, x_range=x_range, width=560)
    mixed = line_chart(
        "groups with non-zero reward variance", [Line("reward/mixed_groups", run.series.get(metrics.REWARD_MIXED_GROUPS, []), PALETTE[5])],
        markers=markers, x_range=x_range, y_range=(0.0, None), width=360,
    )
    return f'<h2>Reward</h2><div class="row">{reward}{mixed}</div>'


def section_states(run: Run) -> str:
    markers, x_range = _alert_markers(run), _x_range(run)
    layers = [(label, colour, run.series.get(key, [])) for key, label, colour in STATE_LAYERS]
    states = stacked_area_chart("structural state of outputs (share of trajectories)", layers, width=560)
    drift = line_chart(
        "format drift and tag balance",
        [Line("collapse/format_drift", run.series.get(metrics.COLLAPSE_FORMAT_DRIFT, []), PALETTE[1]), Line("tokens/tag_balance", run.series.get(metrics.TOKENS_TAG_BALANCE, []), PALETTE[3], dashed=True)],
        markers=markers, x_range=x_range, y_range=(0.0, None), width=360,
    )
    return f'<h2>Structural states</h2><div class="row">{states}{drift}</div>'


def _suffixed(run: Run, prefix: str) -> dict[str, list[tuple[int, float]]]:
    return {k[len(prefix) :]: v for k, v in run.series.items() if k.startswith(prefix) and len(k) > len(prefix)}


def tag_order(tags: Iterable[str]) -> list[str]:
    """Tags in the template's order (opening tag next to its closing tag), unknown ones after."""
    known = {t: i for i, t in enumerate(CONTROL_TAGS)}
    return sorted(tags, key=lambda t: (known.get(t, len(known)), t))


def section_kl(run: Run) -> str:
    markers, x_range = _alert_markers(run), _x_range(run)
    overview = line_chart(
        "KL to the reference (k3 per policy token)",
        [Line("kl/mean", run.series.get(metrics.KL_MEAN, []), "#111827"), Line("kl/text", run.series.get(metrics.KL_TEXT, []), PALETTE[0], dashed=True)],
        markers=markers, x_range=x_range, y_range=(0.0, None), width=560,
    )
    share = line_chart(
        "share of KL carried by control tags",
        [Line("kl/control_share", run.series.get(metrics.KL_CONTROL_SHARE, []), PALETTE[1])],
        markers=markers, x_range=x_range, y_range=(0.0, 1.0), width=360,
    )
    tags = _suffixed(run, metrics.KL_TAG_PREFIX)
    rows = [(tag, tags[tag]) for tag in tag_order(tags)] + ([("text (non-tag)", run.series[metrics.KL_TEXT])] if run.series.get(metrics.KL_TEXT) else [])
    heat = heatmap("mean k3 KL per token class × step", rows)
    return f'<h2>KL by token class</h2><div class="row">{overview}{share}</div>{heat}'


def section_frequency(run: Run) -> str:
    policy = _suffixed(run, metrics.TOKENS_CONTROL_FREQ_PREFIX)
    reference = _suffixed(run, metrics.TOKENS_CONTROL_FREQ_REF_PREFIX)
    tags = tag_order(set(policy) | set(reference))
    if not tags:
        return '<h2>Control-token frequency</h2><p class="note">No control-token frequencies logged yet.</p>'
    markers, x_range = _alert_markers(run), _x_range(run)
    charts = [
        line_chart(tag, [Line("policy", policy.get(tag, []), PALETTE[0]), Line("reference", reference.get(tag, []), "#6b7280", dashed=True)],
                   markers=markers, x_range=x_range, y_range=(0.0, None), width=300, height=170)
        for tag in tags
    ]
    rows = []
    for tag in tags:
        p = policy.get(tag, [])[-1][1] if policy.get(tag) else None
        r = reference.get(tag, [])[-1][1] if reference.get(tag) else None
        ratio = format_number(p / r) if p is not None and r else "–"
        rows.append(f"<tr><td><code>{escape(tag)}</code></td><td>{escape(format_number(p))}</td><td>{escape(format_number(r))}</td><td>{escape(ratio)}</td></tr>")
    table = "<table><tr><th>tag</th><th>policy (last step)</th><th>reference</th><th>ratio</th></tr>" + "".join(rows) + "</table>"
    return f'<h2>Control-token frequency vs reference (per trajectory)</h2><div class="row">{"".join(charts)}</div>{table}'


def section_optimisation(run: Run) -> str:
    markers, x_range = _alert_markers(run), _x_range(run)
    losses = sorted(k for k in run.series if k.startswith("loss/") and k not in (metrics.LOSS_GRAD_NORM, metrics.LOSS_SKIPPED, metrics.LOSS_RATIO_MEAN) and not k.endswith("_frac"))
    loss = line_chart("losses", [Line(k, run.series[k], PALETTE[i % len(PALETTE)]) for i, k in enumerate(losses)], markers=markers, x_range=x_range, width=440)
    entropy = line_chart("policy entropy on its own tokens", [Line("tokens/entropy", run.series.get(metrics.TOKENS_ENTROPY, []), PALETTE[2])], markers=markers, x_range=x_range, y_range=(0.0, None), width=440)
    tools = line_chart("tools per question (training batch)", [Line("tools/per_question", run.series.get(metrics.TOOLS_PER_QUESTION, []), PALETTE[4])], markers=markers, x_range=x_range, y_range=(0.0, None), width=440)
    speed = line_chart(
        "throughput and step time",
        [Line("rollout/tokens_per_s", run.series.get(metrics.ROLLOUT_TOKENS_PER_S, []), PALETTE[5]), Line("time/step_s", run.series.get(metrics.TIME_STEP, []), PALETTE[8], dashed=True)],
        x_range=x_range, y_range=(0.0, None), width=440,
    )
    return f'<h2>Optimisation and throughput</h2><div class="row">{loss}{entropy}{tools}{speed}</div>'


def section_eval_questions(run: Run) -> str:
    if not run.evals:
        return '<h2>Dev questions</h2><p class="note">No per-question eval files (eval/step_*.jsonl) yet.</p>'
    step, path = list(run.evals.items())[-1]
    rows, problems = read_jsonl(path)
    columns = [c for c in EVAL_COLUMNS if any(c in r for r in rows)]
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = ["<tr>" + "".join(f"<td>{_json_cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows[:MAX_EVAL_ROWS]]
    more = f'<p class="note">{len(rows) - MAX_EVAL_ROWS} more questions in {escape(path.name)}.</p>' if len(rows) > MAX_EVAL_ROWS else ""
    bad = "".join(f'<p class="note">{escape(p)}</p>' for p in problems)
    return (
        f"<h2>Dev questions</h2>{bad}<details><summary>per-question results at step {step} ({len(rows)} questions, {escape(path.name)})</summary>"
        f'<table class="small"><tr>{head}</tr>{"".join(body)}</table>{more}</details>'
    )


# ----------------------------------------------------------------------------------------------
# Trajectory viewer
# ----------------------------------------------------------------------------------------------


def _tokens_html(token_ids: list[Any], sources: list[Any], pieces: list[str], logprobs: list[Any]) -> str:
    """Token spans coloured by source; the prompt is folded (it is long and the same in every
    sample); control-tag tokens are outlined."""
    labels = token_tag_labels(pieces)
    prompt_end = 0
    while prompt_end < len(sources) and sources[prompt_end] == 0 and not isinstance(sources[prompt_end], bool):
        prompt_end += 1

    def span(i: int) -> str:
        raw = sources[i]
        source = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw in SOURCE_NAMES else "x"
        logprob = _number(logprobs[i]) if i < len(logprobs) else None
        tip = f"#{i} id {token_ids[i]} · {SOURCE_NAMES.get(source, 'unknown source')}" + (f" · logprob {logprob:.3f}" if logprob is not None and source == 1 else "")
        tag = " ctl" if labels[i] else ""
        return f'<span class="s{source}{tag}" title="{escape(tip)}">{escape(pieces[i])}</span>'

    out = []
    if prompt_end:
        out.append(f'<details class="prompt"><summary>prompt ({prompt_end} tokens)</summary><div class="tokens">{"".join(span(i) for i in range(prompt_end))}</div></details>')
    shown_end = min(len(token_ids), prompt_end + MAX_TOKENS)
    out.append('<div class="tokens">' + "".join(span(i) for i in range(prompt_end, shown_end)) + "</div>")
    if shown_end < len(token_ids):
        out.append(f'<p class="note">{len(token_ids) - shown_end} more tokens not shown.</p>')
    return "".join(out)


def _clip(text: Any, limit: int = MAX_TEXT) -> str:
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)
    return s if len(s) <= limit else s[:limit] + f" … [{len(s) - limit} more characters]"


def _steps_html(steps: Any) -> str:
    if not isinstance(steps, list) or not steps:
        return '<p class="note">No tool calls.</p>'
    rows = []
    for s in steps:
        if not isinstance(s, dict):
            rows.append('<tr><td colspan="4" class="note">unreadable step</td></tr>')
            continue
        call = s.get("call") if isinstance(s.get("call"), dict) else {}
        observation = s.get("observation") if isinstance(s.get("observation"), dict) else {}
        if call.get("error"):
            call_text = f'<span class="bad">{escape(call.get("error"))}</span><pre>{escape(_clip(call.get("raw", "")))}</pre>'
        else:
            call_text = f'<b>{escape(call.get("name", ""))}</b><pre>{escape(_clip(json.dumps(call.get("arguments", {}), ensure_ascii=False, indent=1, default=str)))}</pre>'
        status = "ok" if observation.get("ok", True) else f'<span class="bad">{escape(observation.get("error") or "failed")}</span>'
        rows.append(f'<tr><td>{escape(s.get("turn", ""))}</td><td>{call_text}</td><td>{status}</td><td><pre>{escape(_clip(observation.get("text", "")))}</pre></td></tr>')
    return '<table class="steps"><tr><th>turn</th><th>call</th><th>result</th><th>tool output</th></tr>' + "".join(rows) + "</table>"


def trajectory_html(d: Any, where: str, open_: bool = False) -> str:
    """One trajectory (a `Trajectory.to_dict()` plus optional "pieces"), never raising."""
    if not isinstance(d, dict):
        return f'<p class="note">{escape(where)}: not a trajectory object.</p>'
    token_ids, sources = d.get("token_ids"), d.get("sources")
    pieces, logprobs = d.get("pieces"), d.get("logprobs") if isinstance(d.get("logprobs"), list) else []
    reward = _number(d.get("reward"))
    components = d.get("reward_components") if isinstance(d.get("reward_components"), dict) else {}
    components_text = ", ".join(f"{k} {format_number(_number(v))}" for k, v in components.items())
    flags = [f for f in ("finished", "truncated") if d.get(f) is True]
    head = (
        f'<summary><b>{escape(d.get("task_id", "?"))}</b> · group {escape(d.get("group", "?"))} · reward {escape(format_number(reward))}'
        + (f" ({escape(components_text)})" if components_text else "")
        + (f' · {escape(", ".join(flags))}' if flags else "")
        + f' · answer: <q>{escape(_clip(d.get("answer"), 200)) if d.get("answer") is not None else "<i>none</i>"}</q></summary>'
    )
    body = []
    ok_tokens = isinstance(token_ids, list) and isinstance(sources, list) and len(token_ids) == len(sources)
    if ok_tokens and isinstance(pieces, list) and len(pieces) == len(token_ids) and all(isinstance(p, str) for p in pieces):
        body.append(_tokens_html(token_ids, sources, pieces, logprobs))
    else:
        reason = "token pieces not stored" if pieces is None else "token pieces do not match the token ids"
        body.append(f'<p class="note">{reason}: showing the assistant turn texts.</p>')
        texts = d.get("turn_texts") if isinstance(d.get("turn_texts"), list) else []
        for i, text in enumerate(texts):
            body.append(f'<div class="turn"><span class="turnlabel">assistant turn {i}</span><div class="tokens"><span class="s1">{escape(_clip(text))}</span></div></div>')
        if not texts:
            body.append('<p class="note">No turn texts either.</p>')
    body.append(_steps_html(d.get("steps")))
    return f'<details class="traj"{" open" if open_ else ""}>{head}{"".join(body)}</details>'


def section_samples(run: Run) -> str:
    legend = "".join(
        f'<label class="s{k}"><input type="checkbox" data-src="{k}" checked> {escape(v)}</label>' for k, v in SOURCE_NAMES.items()
    )
    parts = [f'<h2>Trajectories</h2><p class="legend">Token sources (untick to hide): {legend} <span class="ctl">control tag</span></p>']
    if not run.samples:
        parts.append('<p class="note">No samples yet (samples/step_*.jsonl are written at eval steps).</p>')
        return "".join(parts)
    files = list(run.samples.items())
    shown = files[-MAX_SAMPLE_FILES:]
    if len(files) > len(shown):
        parts.append(f'<p class="note">Older sample files not shown: {escape(", ".join(p.name for _, p in files[: -len(shown)]))}.</p>')
    for k, (step, path) in enumerate(reversed(shown)):
        rows, problems = read_jsonl(path)
        inner = "".join(f'<p class="note">{escape(p)}</p>' for p in problems)
        # The first trajectory of the latest file starts unfolded: the viewer is visible at a glance.
        inner += "".join(trajectory_html(r, f"{path.name}:{i + 1}", open_=(k == 0 and i == 0)) for i, r in enumerate(rows[:MAX_TRAJECTORIES]))
        if len(rows) > MAX_TRAJECTORIES:
            inner += f'<p class="note">{len(rows) - MAX_TRAJECTORIES} more trajectories in {escape(path.name)}.</p>'
        if not rows:
            inner += '<p class="note">No readable trajectories in this file.</p>'
        parts.append(f'<details class="samplefile"{" open" if k == 0 else ""}><summary>step {step} · {len(rows)} trajectories</summary>{inner}</details>')
    return "".join(parts)


def section_config(run: Run) -> str:
    parts = []
    if run.problems:
        parts.append("<h2>Data problems</h2><ul>" + "".join(f"<li>{escape(p)}</li>" for p in run.problems[:50]) + "</ul>")
        if len(run.problems) > 50:
            parts.append(f'<p class="note">{len(run.problems) - 50} more.</p>')
    if run.config_text:
        parts.append(f"<details><summary>config.yaml</summary><pre>{escape(run.config_text)}</pre></details>")
    else:
        parts.append('<p class="note">No config.yaml in this run directory.</p>')
    return "".join(parts)


# ----------------------------------------------------------------------------------------------
# Page
# ----------------------------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:20px 28px;color:#111827;background:#fff}
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #e5e7eb;padding-bottom:3px}
h3{font-size:14px;margin:14px 0 6px}.note{color:#6b7280;font-style:italic;margin:4px 0}
.row{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start}figure{margin:0}
figcaption{font-size:12px;color:#374151;max-width:560px}.key{margin-right:10px;white-space:nowrap}.key svg{margin-right:3px}
svg.chart text{font-size:11px;fill:#374151}svg.chart text.title{font-size:12.5px;font-weight:600;fill:#111827}
.grid{stroke:#e5e7eb}.axis{stroke:#9ca3af}.frame{fill:none;stroke:#9ca3af}
.alert line{stroke:#dc2626;stroke-dasharray:3 3;stroke-width:1.2}.alert path{fill:#dc2626}
.peak circle{fill:none;stroke:#111827;stroke-width:1.5}.peak text{font-weight:600}
.cards{display:flex;gap:10px;flex-wrap:wrap}.card{border:1px solid #e5e7eb;border-radius:6px;padding:6px 12px;min-width:120px}
.card .label{font-size:11px;color:#6b7280;text-transform:uppercase}.card .value{font-size:17px;font-weight:600}
table{border-collapse:collapse;margin:6px 0;font-size:13px}td,th{border:1px solid #e5e7eb;padding:3px 7px;vertical-align:top;text-align:left}
th{background:#f9fafb}table.small{font-size:12px}pre{margin:0;white-space:pre-wrap;word-break:break-word;max-width:640px;font-size:12px}
code{font-size:12px;word-break:break-word}.bad{color:#b91c1c;font-weight:600}.verdict{font-size:15px}
details{margin:4px 0}summary{cursor:pointer}details.traj{border:1px solid #e5e7eb;border-radius:6px;padding:4px 8px;margin:6px 0}
.tokens{font:12px/1.6 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-word;margin:6px 0}
.s0{background:#e5e7eb}.s1{background:#dbeafe}.s2{background:#dcfce7}.s3{background:#fef9c3}.s4{background:#ede9fe}.s5{background:#ffedd5}.sx{background:#fecaca}
.ctl{outline:1px solid #dc2626;outline-offset:-1px;font-weight:600}.legend label,.legend span{padding:1px 6px;margin-right:4px;border-radius:3px}
.turnlabel{font-size:11px;color:#6b7280}
.hide-s0 .tokens .s0,.hide-s1 .tokens .s1,.hide-s2 .tokens .s2,.hide-s3 .tokens .s3,.hide-s4 .tokens .s4,.hide-s5 .tokens .s5{display:none}
"""

# The page's only script: source filters for the trajectory viewer. It logs nothing, so the
# browser test can treat any console line as a failure; `data-ready` proves it ran to the end.
SCRIPT = """
document.querySelectorAll('input[data-src]').forEach(function (box) {
  box.addEventListener('change', function () {
    document.body.classList.toggle('hide-s' + box.dataset.src, !box.checked);
  });
});
document.body.setAttribute('data-ready', '1');
"""


def content_security_policy(script: str = SCRIPT) -> str:
    """No fetch of any kind; styles inline; the one script allowed by its hash."""
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'"


def page(title: str, body: str) -> str:
    """A complete HTML document around `body` (already-escaped markup)."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{escape(content_security_policy())}">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}<script>{SCRIPT}</script></body></html>\n"
    )


def render_report(run: Run) -> str:
    """The report page of a loaded run, as a string."""
    sections = [
        f"<h1>Keel run: {escape(run.name)}</h1>",
        f'<p class="note">{escape(run.directory.resolve())}</p>',
        section_summary(run),
        section_verdict(run),
        section_eval(run),
        section_reward(run),
        section_states(run),
        section_kl(run),
        section_frequency(run),
        section_optimisation(run),
        section_eval_questions(run),
        section_samples(run),
        section_config(run),
    ]
    return page(f"Keel report: {run.name}", "".join(sections))


# ----------------------------------------------------------------------------------------------
# The same charts as standalone .svg files (for docs: a Markdown page can embed an image, not a page)
# ----------------------------------------------------------------------------------------------

# the chart rules of STYLE, for an <svg> read on its own
SVG_STYLE = (
    "text{font:11px system-ui,-apple-system,'Segoe UI',sans-serif;fill:#374151}text.title{font-size:12.5px;font-weight:600;fill:#111827}"
    ".grid{stroke:#e5e7eb}.axis{stroke:#9ca3af}.frame{fill:none;stroke:#9ca3af}"
    ".alert line{stroke:#dc2626;stroke-dasharray:3 3;stroke-width:1.2}.alert path{fill:#dc2626}"
    ".peak circle{fill:none;stroke:#111827;stroke-width:1.5}.peak text{font-weight:600}"
)
_CHART = re.compile(r'<svg class="chart" width="(\d+)" height="(\d+)" viewBox="0 0 \d+ \d+" role="img">(.*?)</svg>', re.S)
_KEY = re.compile(r'<span class="key"><svg [^>]*><line [^>]*stroke="([^"]*)"[^>]*?( stroke-dasharray=[^/]*)?/></svg>(.*?)</span>', re.S)
_TITLE = re.compile(r'<text [^>]*class="title">(.*?)</text>', re.S)


def standalone_svgs(section_html: str) -> list[tuple[str, str]]:
    """Every chart of a report section as (title, a complete SVG document): the section's
    <figure>s, each chart with its legend drawn inside the image and the chart styles inline."""
    out = []
    for figure in re.findall(r"<figure>(.*?)</figure>", section_html, re.S):
        chart = _CHART.search(figure)
        if chart is None:
            continue
        width, height, body = int(chart.group(1)), int(chart.group(2)), chart.group(3)
        keys = _KEY.findall(figure[chart.end():])
        legend, x, y = [], 12.0, height + 4
        for colour, dashed, name in keys:
            span = 30 + 6.2 * len(html.unescape(name))
            if x + span > width and x > 12:
                x, y = 12.0, y + 16
            dash = ' stroke-dasharray="4 3"' if dashed else ""
            legend.append(f'<line x1="{x:.0f}" y1="{y + 4}" x2="{x + 18:.0f}" y2="{y + 4}" stroke="{colour}" stroke-width="2"{dash}/>'
                          f'<text x="{x + 22:.0f}" y="{y + 8}">{name}</text>')
            x += span
        total = y + 18 if keys else height
        title = _TITLE.search(body)
        out.append((html.unescape(title.group(1)) if title else "chart",
                    f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" viewBox="0 0 {width} {total}">'
                    f'<style>{SVG_STYLE}</style><rect width="100%" height="100%" fill="#fff"/>{body}{"".join(legend)}</svg>\n'))
    return out


def _slug(text: str) -> str:
    """A file-name part: `</answer>` → "end-answer", "KL to the reference" → "kl-to-the-reference"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("</", "end-")).strip("-") or "chart"


def write_figures(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write each chart of the run's report as `out_dir/<section>-<title>.svg`; return the paths.

    The sections with curves (dev evaluation, reward, structural states, KL by token class,
    control-token frequency, optimisation); a chart with no data is left out. Existing files of
    the same name are replaced (atomically), others in `out_dir` are left alone."""
    run = load_run(run_dir)
    sections = (("eval", section_eval), ("reward", section_reward), ("states", section_states), ("kl", section_kl),
                ("freq", section_frequency), ("optim", section_optimisation))
    return write_svgs([(name, section(run)) for name, section in sections], out_dir)


def write_svgs(parts: list[tuple[str, str]], out_dir: str | os.PathLike) -> list[Path]:
    """Write the charts of each (prefix, HTML) part as `out_dir/<prefix>-<title>.svg`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for prefix, markup in parts:
        for title, svg in standalone_svgs(markup):
            stem = f"{prefix}-{_slug(title)}"
            target, n = out / f"{stem}.svg", 1
            while target in written:  # two charts whose titles differ only in punctuation
                n += 1
                target = out / f"{stem}-{n}.svg"
            atomic_write_text(target, svg)
            written.append(target)
    return written


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write `report.html` (or `out`) for a run directory and return its path.

    Missing parts of the run (no eval yet, no samples, no diagnosis) become short notes.
    Raises FileNotFoundError only when `run_dir` itself does not exist.
    """
    run = load_run(run_dir)
    target = Path(out) if out is not None else run.directory / "report.html"
    atomic_write_text(target, render_report(run))
    return target
