"""docs/RESULTS.md and README.md name only runs whose small artifacts are committed under results/,
and results/ holds no checkpoints."""

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


def test_results_hold_no_checkpoints():
    heavy = [p.relative_to(REPO).as_posix() for p in (REPO / "results").rglob("*")
             if p.is_file() and (p.suffix in (".safetensors", ".pt", ".bin") or "checkpoints" in p.parts)]
    assert not heavy, f"checkpoints under results/: {heavy[:5]}"
