"""Several runs side by side: overlaid curves on one page and a table of their eval metrics
with Wilson 95% intervals and McNemar tests between runs scored on the same questions.

Paper B reports EM / CvT with Wilson intervals and compares checkpoints with McNemar tests on
the same test questions; this module does that from the per-question `eval/step_*.jsonl`
files of each run. Departures: McNemar is exact (binomial) when the discordant count is below
25 and chi-square with continuity correction otherwise, and the table says which; p-values are
also given Holm-adjusted over all tests of one comparison, since a sweep makes many pairs.

`pool=True` reads several seeds of one setting as one arm: runs whose config.yaml agree on every
key outside `run.*` (seed, threads, progress, ...) form an arm; an arm's shares are over all its
runs' question-answers, and two arms are tested on the (seed, question) pairs both evaluated
(McNemar's discordant counts summed over the seeds they share, each seed's runs paired question by
question). Repeated questions across seeds are not independent draws, so a pooled p-value is
a statement about these seeds on this question set, not about new questions.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from pathlib import Path
from typing import Any, Iterable

from keel import metrics
from keel.errors import UserError
from keel.report import PALETTE, Line, escape, line_chart, load_run, page
from keel.rundir import atomic_write_text, read_jsonl, step_files

Z95 = 1.959963984540054  # two-sided 95% normal quantile
EXACT_BELOW = 25  # discordant pairs below this: exact binomial McNemar (chi-square is poor there)
BINARY_FIELDS = ("em", "cvt", "format_valid")  # 0/1 per question: Wilson intervals, McNemar
MEAN_FIELDS = ("f1", "tools")  # continuous per question: mean ± 1.96 standard errors
PAIRED_FIELDS = ("em", "cvt")
OVERLAY = (
    (metrics.EVAL_EM, "dev EM"),
    (metrics.EVAL_CVT, "dev CvT"),
    (metrics.EVAL_F1, "dev F1"),
    (metrics.EVAL_TOOLS_PER_QUESTION, "dev tools per question"),
    (metrics.REWARD_MEAN, "reward/mean"),
    (metrics.KL_MEAN, "kl/mean"),
    (metrics.COLLAPSE_HEALTHY_CALL, "share of healthy tool calls"),
    (metrics.TOKENS_ENTROPY, "policy entropy"),
)


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    centre = (p + z²/2n) / (1 + z²/n);  half = z/(1 + z²/n) · sqrt(p(1-p)/n + z²/4n²).
    Unlike p ± z·sqrt(p(1-p)/n) it never leaves [0, 1] and is not zero-width at p = 0 or 1.
    """
    if n <= 0:
        raise ValueError(f"wilson_interval: n must be positive, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes must be in [0, n={n}], got {successes}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At k = 0 (k = n) the lower (upper) end is exactly 0 (1); rounding would leave 1e-17 off.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high) with the normal approximation mean ± z·s/√n (s: sample std, n-1)."""
    if not values:
        raise ValueError("mean_interval: no values")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass
class McNemar:
    """b: questions only run A got right; c: only run B. method: 'exact' or 'chi2_cc'."""

    b: int
    c: int
    method: str
    statistic: float  # chi-square value, or for 'exact' the smaller discordant count
    p_value: float


def mcnemar(b: int, c: int, exact_below: int = EXACT_BELOW) -> McNemar:
    """McNemar test of paired binary outcomes from the two discordant counts.

    Exact: under H0 each discordant pair is A-only with probability 1/2, so
    p = min(1, 2·P[X ≤ min(b, c)]) with X ~ Binomial(b + c, 1/2).
    Chi-square with continuity correction: χ² = (|b − c| − 1)² / (b + c), 1 degree of freedom,
    p = erfc(sqrt(χ²/2)); |b − c| − 1 is floored at 0 so b = c gives p = 1.
    """
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar: discordant counts must be non-negative, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return McNemar(b, c, "exact", 0.0, 1.0)
    if n < exact_below:
        k = min(b, c)
        tail = Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n)
        return McNemar(b, c, "exact", float(k), float(min(Fraction(1), 2 * tail)))
    chi2 = max(0, abs(b - c) - 1) ** 2 / n
    return McNemar(b, c, "chi2_cc", chi2, math.erfc(math.sqrt(chi2 / 2)))


def paired_lift(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], field: str = "em",
                exact_below: float = math.inf) -> dict[str, Any]:
    """`after` against `before` on the questions both evaluated (`read_eval` dicts), with a
    McNemar test on the discordant pairs (exact at any count by default):
    {lift, p_value, method, statistic, n, gained, lost, before, after}.

    Worked example: before em 1,0,0,0,1,0,0,0,0,0 and after 1,1,1,1,0,1,1,1,1,0 → gained 7,
    lost 1, n 10, lift 0.8 − 0.2 = 0.6, p = 2·P[X ≤ 1], X ~ Bin(8, ½) = 2·9/256 = 0.0703125.
    """
    shared = sorted(q for q in set(before) & set(after) if field in before[q] and field in after[q])
    gained = sum(1 for q in shared if after[q][field] > before[q][field])
    lost = sum(1 for q in shared if after[q][field] < before[q][field])
    n = len(shared)
    mean_before = sum(before[q][field] for q in shared) / n if n else 0.0
    mean_after = sum(after[q][field] for q in shared) / n if n else 0.0
    test = mcnemar(gained, lost, exact_below)
    return {"lift": mean_after - mean_before, "p_value": test.p_value, "method": test.method, "statistic": test.statistic, "n": n,
            "gained": gained, "lost": lost, "before": mean_before, "after": mean_after}


def holm(p_values: list[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order.

    Worked example: [0.01, 0.04, 0.03] → sorted 0.01, 0.03, 0.04 × (3, 2, 1) = 0.03, 0.06, 0.04
    → running max 0.03, 0.06, 0.06 → in input order [0.03, 0.06, 0.06].
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# ----------------------------------------------------------------------------------------------
# Per-question eval files
# ----------------------------------------------------------------------------------------------


def _binary(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    raise UserError(f"{where}: {name} must be 0 or 1 (or true/false) per question, got {value!r}")


def read_eval(path: Path) -> dict[str, dict[str, float]]:
    """{task_id: {field: value}} of one per-question eval file, strictly checked.

    Only a torn last line is tolerated (a crash mid-write); any other bad line, a missing or
    repeated task_id, or a non-0/1 binary field raises ValueError naming file and line, since
    a silently dropped question would change n and every interval.
    """
    rows, problems = read_jsonl(path)
    bad = [p for p in problems if "torn last line" not in p]
    if bad:
        raise UserError(f"{path}: {bad[0]}")
    out: dict[str, dict[str, float]] = {}
    for number, row in enumerate(rows, start=1):
        where = f"{path}: row {number}"
        task_id = row.get("task_id")
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise UserError(f"{where}: missing task_id")
        task_id = str(task_id)
        if task_id in out:
            raise UserError(f"{where}: task_id {task_id!r} appears twice")
        record: dict[str, float] = {}
        for name in BINARY_FIELDS:
            if name in row and row[name] is not None:
                record[name] = float(_binary(row[name], where, name))
        for name in MEAN_FIELDS:
            value = row.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(f"{where}: {name} must be a finite number, got {value!r}")
            record[name] = float(value)
        if isinstance(row.get("question_hash"), str):  # question + gold answers (keel.evaluate.question_hash)
            record["question_hash"] = row["question_hash"]
        out[task_id] = record
    if not out:
        raise UserError(f"{path}: no questions")
    return out


def choose_eval(run_dir: Path, at: str | int = "final") -> tuple[int, Path]:
    """The eval file to compare: the last one ('final'), the one with the highest EM ('peak',
    earliest on ties), or a given step."""
    files = step_files(run_dir / "eval")
    if not files:
        raise UserError(f"{run_dir}: no per-question eval files (eval/step_*.jsonl)")
    if at == "final":
        step = max(files)
    elif at == "peak":
        def em_of(step: int) -> float:
            rows = read_eval(files[step])
            values = [r["em"] for r in rows.values() if "em" in r]
            return sum(values) / len(values) if values else -1.0

        step = max(sorted(files), key=em_of)
    elif isinstance(at, int) and not isinstance(at, bool):
        if at not in files:
            raise UserError(f"{run_dir}: no eval file for step {at} (have {sorted(files)})")
        step = at
    else:
        raise UserError(f"at must be 'final', 'peak' or a step number, got {at!r}")
    return step, files[step]


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def summarise(questions: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per field: mean, low, high, n (and successes for binary fields)."""
    out: dict[str, dict[str, float]] = {}
    for name in BINARY_FIELDS:
        values = [q[name] for q in questions.values() if name in q]
        if values:
            k, n = int(sum(values)), len(values)
            low, high = wilson_interval(k, n)
            out[name] = {"mean": k / n, "low": low, "high": high, "n": n, "successes": k, "interval": "wilson"}
    for name in MEAN_FIELDS:
        values = [q[name] for q in questions.values() if name in q]
        if values:
            mean, low, high = mean_interval(values)
            out[name] = {"mean": mean, "low": low, "high": high, "n": len(values), "interval": "normal"}
    return out


def _names(run_dirs: list[Path], names: list[str] | None) -> list[str]:
    if names is not None:
        if len(names) != len(run_dirs):
            raise UserError(f"names: {len(names)} names for {len(run_dirs)} runs")
        return list(names)
    base = [d.resolve().name for d in run_dirs]
    # Seeds of one sweep often share a folder name under different parents: add the parent.
    return [b if base.count(b) == 1 else f"{d.resolve().parent.name}/{b}" for b, d in zip(base, run_dirs)]


def check_same_questions(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]], name_a: str, name_b: str) -> None:
    """Paired tests pair questions by id; refuse two eval files in which one id names two
    different questions (runs on different data whose ids happen to coincide, e.g. q1, q2...).
    Files written before question hashes were recorded cannot be checked and pass."""
    differ = [k for k in a.keys() & b.keys() if "question_hash" in a[k] and "question_hash" in b[k]
              and a[k]["question_hash"] != b[k]["question_hash"]]
    if differ:
        raise UserError(f"compare: {name_a} and {name_b} share question ids but not questions ({len(differ)} of "
                        f"{len(a.keys() & b.keys())} common ids differ, e.g. {sorted(differ)[0]!r}): they were evaluated on "
                        "different data, so a paired test would pair unrelated questions")


def compare_runs(
    run_dirs: Iterable[str | os.PathLike],
    out: str | os.PathLike | None = None,
    *,
    at: str | int = "final",
    names: list[str] | None = None,
    references: dict[str, dict[str, float]] | None = None,
    exact_below: int = EXACT_BELOW,
    pool: bool = False,
    rl_axis: bool = False,
) -> dict[str, Any]:
    """Compare runs on their per-question eval results and, if `out` is given, write an HTML
    page overlaying their curves.

    pool: group the runs into arms (`pool_arms`: same config outside `run.*`, one run per seed)
        and test arms against each other on their pooled (seed, question) pairs instead of
        testing every pair of runs; result["arms"] and result["arm_tests"].
    at: which eval of each run ('final', 'peak' by EM, or a step number).
    references: rows of reported numbers to print alongside (e.g. a paper's table),
        {"paper B R-selfV": {"em": 0.395, "cvt": 0.0957}}; shown without intervals.
    Returns {"runs": [...], "tests": [...], "references": {...}, "table": str, "html": path|None}.
    Each test: {"a", "b", "field", "n_common", "b_only", "c_only", "method", "statistic",
    "p_value", "p_holm"} where b_only counts questions only run a got right.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise UserError("compare_runs: no run directories given")
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"run directory {d} does not exist or is not a directory")
    labels = _names(dirs, names)
    runs: list[dict[str, Any]] = []
    questions: list[dict[str, dict[str, float]]] = []
    for label, d in zip(labels, dirs):
        step, path = choose_eval(d, at)
        q = read_eval(path)
        questions.append(q)
        runs.append({"name": label, "dir": str(d), "step": step, "file": str(path), "n": len(q), "metrics": summarise(q)})
    tests: list[dict[str, Any]] = []
    pairs = [] if pool else list(combinations(enumerate(runs), 2))
    for (i, a), (j, b) in pairs:
        check_same_questions(questions[i], questions[j], a["file"], b["file"])
        for name in PAIRED_FIELDS:
            pair = paired_lift(questions[i], questions[j], name, exact_below)  # "lost" = right in a only
            if not pair["n"]:
                continue
            tests.append({
                "a": a["name"], "b": b["name"], "field": name, "n_common": pair["n"],
                "n_a": len(questions[i]), "n_b": len(questions[j]),
                "b_only": pair["lost"], "c_only": pair["gained"], "method": pair["method"],
                "statistic": pair["statistic"], "p_value": pair["p_value"],
            })
    for test, adjusted in zip(tests, holm([t["p_value"] for t in tests])):
        test["p_holm"] = adjusted
    result: dict[str, Any] = {"runs": runs, "tests": tests, "references": dict(references or {}), "at": at, "html": None}
    if pool:
        result["arms"], result["arm_tests"] = pool_arms(dirs, runs, questions, exact_below)
    result["table"] = format_table(result)
    if out is not None:
        atomic_write_text(Path(out), render_comparison(result, dirs, rl_axis))
        result["html"] = str(out)
    return result


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config mapping as written, flat: {"grpo": {"lr": 1e-5}} → {"grpo.lr": 1e-5}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _run_config(run_dir: Path) -> dict[str, Any]:
    """A run's config, flat, as this Keel reads it: keys added since the run was made take their
    defaults, so runs of one setting made by different versions fall into one arm. A config this
    version no longer accepts (a key since renamed) is compared as written."""
    import yaml

    from keel.config import leaves, load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"compare --pool: {path} is missing: arms are read from each run's config")
    try:
        return leaves(load_config(path))
    except (UserError, ValueError, TypeError):
        pass
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UserError(f"compare --pool: {path} is not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"compare --pool: {path} holds no config mapping")
    return _flat(data)


def pool_arms(dirs: list[Path], runs: list[dict[str, Any]], questions: list[dict[str, dict[str, float]]],
              exact_below: int = EXACT_BELOW) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Arms of runs that differ only in `run.*` (seeds of one setting), pooled.

    Returns (arms, tests). Arm: {"name", "runs", "seeds", "settings" (its values of the config
    keys that differ between arms), "n", "metrics" (summarise over every (seed, question))}. Test:
    {"a", "b", "field", "seeds", "n_common", "b_only", "c_only", "method", "statistic",
    "p_value", "p_holm"}, counts summed over the seeds both arms ran; b_only = right in arm a only.
    Raises UserError for an arm with two runs of one seed (pairing is by seed).
    """
    configs = [_run_config(d) for d in dirs]
    keyed: dict[str, list[int]] = {}
    for i, c in enumerate(configs):
        setting = {k: v for k, v in c.items() if not k.startswith("run.")}
        keyed.setdefault(json.dumps(setting, sort_keys=True, default=str), []).append(i)
    groups = list(keyed.values())
    differing = sorted(k for k in set().union(*(c.keys() for c in configs)) if not k.startswith("run.")
                       and len({json.dumps(configs[g[0]].get(k), sort_keys=True, default=str) for g in groups}) > 1)
    arms: list[dict[str, Any]] = []
    seeds_of: list[dict[int, int]] = []
    for members in groups:
        by_seed: dict[int, int] = {}
        for i in members:
            seed = configs[i].get("run.seed")
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise UserError(f"compare --pool: {dirs[i] / 'config.yaml'} has no integer run.seed")
            if seed in by_seed:
                raise UserError(f"compare --pool: {runs[by_seed[seed]]['name']} and {runs[i]['name']} have the same setting and "
                                f"seed {seed}; an arm pairs its runs with other arms' by seed, so it takes one run per seed")
            by_seed[seed] = i
        stems = sorted({re.sub(r"-s\d+$", "", runs[i]["name"]) for i in members})
        pooled = {f"s{seed}/{q}": rec for seed, i in sorted(by_seed.items()) for q, rec in questions[i].items()}
        arms.append({"name": stems[0] if len(stems) == 1 else "|".join(stems), "runs": [runs[i]["name"] for i in members],
                     "seeds": sorted(by_seed), "settings": {k: configs[members[0]].get(k) for k in differing},
                     "n": len(pooled), "metrics": summarise(pooled)})
        seeds_of.append(by_seed)
    for name in {a["name"] for a in arms}:  # two settings whose runs share a folder name: number them
        same = [a for a in arms if a["name"] == name]
        if len(same) > 1:
            for k, a in enumerate(same, start=1):
                a["name"] = f"{name}#{k}"
    tests: list[dict[str, Any]] = []
    for (i, a), (j, b) in combinations(enumerate(arms), 2):
        shared_seeds = sorted(set(seeds_of[i]) & set(seeds_of[j]))
        for field in PAIRED_FIELDS:
            only_a = only_b = n = 0
            for seed in shared_seeds:
                qa, qb = questions[seeds_of[i][seed]], questions[seeds_of[j][seed]]
                check_same_questions(qa, qb, runs[seeds_of[i][seed]]["file"], runs[seeds_of[j][seed]]["file"])
                pair = paired_lift(qa, qb, field)
                only_a, only_b, n = only_a + pair["lost"], only_b + pair["gained"], n + pair["n"]
            if not n:
                continue
            test = mcnemar(only_a, only_b, exact_below)
            tests.append({"a": a["name"], "b": b["name"], "field": field, "seeds": shared_seeds, "n_common": n,
                          "b_only": only_a, "c_only": only_b, "method": test.method, "statistic": test.statistic, "p_value": test.p_value})
    for test, adjusted in zip(tests, holm([t["p_value"] for t in tests])):
        test["p_holm"] = adjusted
    return arms, tests


def _setting(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def arm_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["arm", "seeds", "n", "EM k/n", "EM % [95% CI]", "CvT % [95% CI]", "format valid % [95% CI]", "setting"]
    rows = []
    for a in result["arms"]:
        m = a["metrics"]
        em = m.get("em")
        rows.append([a["name"], ",".join(map(str, a["seeds"])), str(a["n"]), f"{em['successes']}/{em['n']}" if em else "–",
                     _cell(em, True), _cell(m.get("cvt"), True), _cell(m.get("format_valid"), True),
                     "; ".join(f"{k}={_setting(v)}" for k, v in a["settings"].items())])
    return header, rows


def arm_test_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["arm A", "arm B", "metric", "seeds", "pairs", "only A right", "only B right", "test", "statistic", "p", "p (Holm)"]
    rows = []
    for t in result["arm_tests"]:
        test = "exact binomial" if t["method"] == "exact" else "chi-square, continuity-corrected"
        rows.append([t["a"], t["b"], t["field"], ",".join(map(str, t["seeds"])), str(t["n_common"]), str(t["b_only"]), str(t["c_only"]),
                     test, f"{t['statistic']:.3f}", f"{t['p_value']:.4g}", f"{t['p_holm']:.4g}"])
    return header, rows


def _cell(m: dict[str, float] | None, percent: bool) -> str:
    if not m:
        return "–"
    if percent:
        return f"{100 * m['mean']:.1f} [{100 * m['low']:.1f}, {100 * m['high']:.1f}]"
    return f"{m['mean']:.3f} ± {(m['high'] - m['low']) / 2:.3f}"


def metric_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the metric table (percent for binary fields, as the papers print)."""
    header = ["run", "step", "n", "EM % [95% CI]", "CvT % [95% CI]", "format valid % [95% CI]", "F1 ± 1.96 SE", "tools/question ± 1.96 SE"]
    rows = []
    for r in result["runs"]:
        m = r["metrics"]
        rows.append([r["name"], str(r["step"]), str(r["n"]), _cell(m.get("em"), True), _cell(m.get("cvt"), True), _cell(m.get("format_valid"), True), _cell(m.get("f1"), False), _cell(m.get("tools"), False)])
    for name, values in result.get("references", {}).items():
        def ref(key: str, percent: bool) -> str:
            v = values.get(key)
            return "–" if v is None else (f"{100 * v:.1f}" if percent else f"{v:.3f}")

        rows.append([f"{name} (reported)", "–", str(values.get("n", "–")), ref("em", True), ref("cvt", True), ref("format_valid", True), ref("f1", False), ref("tools", False)])
    return header, rows


def mcnemar_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["run A", "run B", "metric", "n shared", "only A right", "only B right", "test", "statistic", "p", "p (Holm)"]
    rows = []
    for t in result["tests"]:
        test = "exact binomial" if t["method"] == "exact" else "chi-square, continuity-corrected"
        rows.append([t["a"], t["b"], t["field"], str(t["n_common"]), str(t["b_only"]), str(t["c_only"]), test, f"{t['statistic']:.3f}", f"{t['p_value']:.4g}", f"{t['p_holm']:.4g}"])
    return header, rows


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_table(result: dict[str, Any]) -> str:
    """The printed comparison: metric table, then McNemar tests (with the method of each)."""
    at = result.get("at", "final")
    parts = [f"Eval metrics at the {at if isinstance(at, str) else f'step {at}'} eval of each run (Wilson 95% intervals for shares):", _text_table(*metric_rows(result))]
    if result["tests"]:
        parts += ["", f"McNemar tests on shared questions (exact binomial when fewer than {EXACT_BELOW} discordant pairs, else chi-square with continuity correction):", _text_table(*mcnemar_rows(result))]
        unequal = {(t["a"], t["b"]) for t in result["tests"] if not (t["n_common"] == t["n_a"] == t["n_b"])}
        if unequal:
            parts.append("note: " + "; ".join(f"{a} vs {b} share only part of their questions" for a, b in sorted(unequal)))
    elif "arms" in result:
        parts += ["", "Arms (runs whose configs differ only in run.*, pooled over their seeds' question-answers; Wilson 95% intervals):",
                  _text_table(*arm_rows(result))]
        if result["arm_tests"]:
            parts += ["", f"McNemar tests between arms on the (seed, question) pairs both ran, discordant counts summed over seeds (exact "
                          f"binomial when fewer than {EXACT_BELOW}, else chi-square with continuity correction; Holm over these tests):",
                      _text_table(*arm_test_rows(result))]
            untested = [f"{a['name']} and {b['name']}" for a, b in combinations(result["arms"], 2) if not set(a["seeds"]) & set(b["seeds"])]
            if untested:
                parts.append("note: not tested, no seed in common: " + "; ".join(untested))
        elif len(result["arms"]) > 1:
            parts += ["", "No McNemar tests between arms: no two arms share a seed and questions."]
    elif len(result["runs"]) > 1:
        parts += ["", "No McNemar tests: the runs share no evaluated questions."]
    return "\n".join(parts)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    return "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>" + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows) + "</table>"


def _on_rl_axis(points: list[tuple[int, float]], rl_step: dict[int, int | None]) -> list[tuple[int, float]]:
    """Points re-placed at the RL steps done by their step (keel.report.rl_steps); points of SFT
    steps are left out. A step no line logged (an eval recomputed from its file) takes the RL
    count of the nearest logged step before it.

    Worked example: rl_step {0: 0, 1: 1, 2: 2, 3: None, 5: 3}, points (0, a) (2, b) (3, c) (5, d)
    (7, e) → (0, a) (2, b) (3, d) (3, e)."""
    placed = sorted((s, r) for s, r in rl_step.items() if r is not None)
    out = []
    for step, value in points:
        if step in rl_step:
            if rl_step[step] is not None:
                out.append((rl_step[step], value))
            continue
        before = [r for s, r in placed if s < step]
        out.append((before[-1] if before else 0, value))
    return out


def comparison_charts(result: dict[str, Any], loaded: list, rl_axis: bool = False) -> list[str]:
    """The overlaid curves of every run, one chart per OVERLAY metric (HTML figures).
    rl_axis: x is RL steps done (supervision phases and SFT steps left out), so runs with
    interleaved phases line up with runs without; else the logged step."""
    colours = {r["name"]: PALETTE[i % len(PALETTE)] for i, r in enumerate(result["runs"])}
    charts = []
    for key, title in OVERLAY:
        lines = [Line(r["name"], _on_rl_axis(run.series.get(key, []), run.rl_step) if rl_axis else run.series.get(key, []), colours[r["name"]],
                      dots=key.startswith("eval/")) for r, run in zip(result["runs"], loaded)]
        charts.append(line_chart(title + (" (x: RL steps)" if rl_axis else ""), lines, y_range=(0.0, None), width=440))
    return charts


def write_comparison_figures(result: dict[str, Any], dirs: list[Path], out_dir: str | os.PathLike, rl_axis: bool = False) -> list[Path]:
    """The comparison's curves as standalone `out_dir/compare-<title>.svg` files (keel.report.write_svgs)."""
    from keel.report import write_svgs

    return write_svgs([("compare", chart) for chart in comparison_charts(result, [load_run(d) for d in dirs], rl_axis)], out_dir)


def render_comparison(result: dict[str, Any], dirs: list[Path], rl_axis: bool = False) -> str:
    """HTML page: overlaid curves of every run, the metric table and the tests."""
    loaded = [load_run(d) for d in dirs]
    charts = comparison_charts(result, loaded, rl_axis)
    body = [
        f"<h1>Keel comparison of {len(loaded)} runs</h1>",
        f'<p class="note">{escape(", ".join(str(d.resolve()) for d in dirs))}</p>',
        "<h2>Eval metrics (Wilson 95% intervals for shares)</h2>",
        _html_table(*metric_rows(result)),
    ]
    if result["tests"]:
        body += [f"<h2>McNemar tests on shared questions</h2><p class=\"note\">Exact binomial when fewer than {EXACT_BELOW} discordant pairs, else chi-square with continuity correction; Holm-adjusted over all tests on this page.</p>", _html_table(*mcnemar_rows(result))]
    if "arms" in result:
        body += ["<h2>Arms pooled over seeds</h2><p class=\"note\">Runs whose configs differ only in run.* form an arm; shares over all its "
                 "seeds' question-answers (Wilson 95%).</p>", _html_table(*arm_rows(result))]
        if result["arm_tests"]:
            body += ["<h2>McNemar tests between arms</h2><p class=\"note\">On the (seed, question) pairs both arms ran, discordant counts "
                     "summed over seeds; Holm-adjusted over these tests.</p>", _html_table(*arm_test_rows(result))]
    body += ["<h2>Curves</h2>", f'<div class="row">{"".join(charts)}</div>']
    problems = [f"{run.name}: {p}" for run in loaded for p in run.problems]
    if problems:
        body.append("<h2>Data problems</h2><ul>" + "".join(f"<li>{escape(p)}</li>" for p in problems[:50]) + "</ul>")
    return page("Keel comparison", "".join(body))
