"""docs/RESULTS.md and README.md name only runs whose small artifacts are committed under results/,
and results/ holds no checkpoints."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`(results/[^`\s]+)`")


def _named_runs() -> list[str]:
    names: list[str] = []
    for doc in ("docs/RESULTS.md", "README.md"):
        names += NAMED.findall((REPO / doc).read_text(encoding="utf-8"))
    return sorted(set(names))


def test_every_run_the_docs_name_is_committed_with_its_artifacts():
    named = _named_runs()
    assert named, "RESULTS.md names no run under results/"
    missing = [n for n in named if not (REPO / n).exists()]
    assert not missing, f"named in the docs but not under results/: {missing}"
    for n in named:
        path = REPO / n
        if not path.is_dir():
            continue
        runs = [path] if (path / "config.yaml").exists() else [d for d in path.iterdir() if d.is_dir()]  # a run, or a folder of runs
        assert runs, f"{n}: neither a run directory nor a folder of runs"
        for run in runs:
            assert (run / "config.yaml").exists() and (run / "metrics.jsonl").exists(), f"{run.relative_to(REPO)}: no config.yaml / metrics.jsonl"


def test_paths_inside_commands_exist_too():
    """A `results/...` path inside a longer code span (a command) must exist as written: a shell
    shorthand such as `kg_{grpo,prs}-s0` names nothing a reader can open."""
    missing = []
    for doc in ("docs/RESULTS.md", "README.md"):
        for span in re.findall(r"`([^`]+)`", (REPO / doc).read_text(encoding="utf-8")):
            for path in re.findall(r"(?<![\w/.-])results/[^\s`,;)]+", span):
                if not (REPO / path.rstrip(".:")).exists():
                    missing.append(f"{doc}: {path}")
    assert not missing, missing


def test_every_plot_the_results_show_is_committed_and_every_committed_plot_is_shown():
    text = (REPO / "docs/RESULTS.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"!\[[^\]]*\]\((figures/[^)\s]+)\)", text))
    assert shown, "RESULTS.md shows no plot"
    missing = sorted(f for f in shown if not (REPO / "docs" / f).is_file())
    assert not missing, f"plots shown in RESULTS.md but not under docs/: {missing}"
    stray = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs/figures").rglob("*.svg"))
    stray = [f for f in stray if f not in shown]
    assert not stray, f"plots under docs/figures that RESULTS.md does not show: {stray}"


def test_results_hold_no_checkpoints():
    heavy = [p.relative_to(REPO).as_posix() for p in (REPO / "results").rglob("*")
             if p.is_file() and (p.suffix in (".safetensors", ".pt", ".bin") or "checkpoints" in p.parts)]
    assert not heavy, f"checkpoints under results/: {heavy[:5]}"


# --- the numbers quoted beside a run are that run's ------------------------------------------------

ARROW = re.compile(r"(\d\.\d\d)(?: \[[^\]]*\])? → \**(\d\.\d\d)")  # "0.40 → 0.58", "0.40 [0.28, 0.54] → **0.60**"
GAINED = re.compile(r"(\d+) gained / (\d+) lost")
ROW_COUNTS = re.compile(r"\|\s*(\d+) / (\d+)\s*\|")  # a "gained / lost" table cell


def _units(text: str) -> list[str]:
    """Table rows, and the bullets or paragraphs of the rest: what a run's numbers must share."""
    units, block = [], []
    for line in text.splitlines() + [""]:
        starts_new = not line.strip() or line.lstrip().startswith("|") or re.match(r"\s*- ", line) or line.startswith("#")
        if starts_new and block:
            units.append(" ".join(block))
            block = []
        if line.lstrip().startswith("|"):
            units.append(line.strip())
        elif line.strip() and not line.startswith("#"):
            block.append(line.strip())
    return units


def _lift(run: Path) -> dict:
    """The evaluation RL started from (after SFT; the first one when the summary does not say)
    against the last, from the run's eval records."""
    from keel.compare import paired_lift, read_eval

    evals = sorted((run / "eval").glob("step_*.jsonl"))
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    start = summary.get("eval_after_sft_step", summary.get("eval_before_sft_step"))
    first = run / "eval" / f"step_{start:06d}.jsonl" if start is not None else evals[0]
    return paired_lift(read_eval(first), read_eval(evals[-1]))


def test_numbers_quoted_beside_a_run_are_its_own():
    """Wherever a table row, bullet or paragraph names exactly one run, the first "a → b" after
    its name is the run's EM at the evaluation RL started from and at the last, and "g gained /
    l lost" (or a "g / l" cell) its paired counts; a table row without an arrow holds both EMs."""
    checked = 0
    for doc in ("docs/RESULTS.md", "README.md"):
        for unit in _units((REPO / doc).read_text(encoding="utf-8")):
            runs = sorted({n for n in NAMED.findall(unit) if (REPO / n / "eval").is_dir()})
            if len(runs) != 1 or len(list((REPO / runs[0] / "eval").glob("step_*.jsonl"))) < 2:
                continue
            lift = _lift(REPO / runs[0])
            where = f"{doc}, beside {runs[0]}: {unit[:90]}…"
            arrow = ARROW.search(unit[unit.index(runs[0]):])
            if arrow:
                assert (float(arrow[1]), float(arrow[2])) == (round(lift["before"], 2), round(lift["after"], 2)), where
                checked += 1
            counts = GAINED.search(unit) or (ROW_COUNTS.search(unit) if unit.startswith("|") else None)
            if counts:
                assert (int(counts[1]), int(counts[2])) == (lift["gained"], lift["lost"]), where
                checked += 1
            if unit.startswith("|") and not arrow:  # a row: its EM cells
                cells = re.findall(r"\b\d\.\d\d\b", unit)
                assert f"{lift['before']:.2f}" in cells and f"{lift['after']:.2f}" in cells, where
                checked += 1
    assert checked >= 25, f"only {checked} quoted numbers were checked against their runs"


def test_summaries_that_carry_rl_lift_agree_with_their_eval_records():
    checked = 0
    for summary in sorted((REPO / "results").rglob("summary.json")):
        s = json.loads(summary.read_text())
        if "rl_lift/em" not in s:
            continue
        lift = _lift(summary.parent)
        assert (s["rl_lift/gained"], s["rl_lift/lost"], s["rl_lift/n"]) == (lift["gained"], lift["lost"], lift["n"]), summary
        assert abs(s["rl_lift/em"] - lift["lift"]) < 1e-9 and abs(s["rl_lift/p_value"] - lift["p_value"]) < 1e-9, summary
        checked += 1
    assert checked >= 5, f"only {checked} summaries carry rl_lift/*"
