"""`keel sweep`: a sweep killed with SIGKILL and run again with the same command ends with the
same runs, step for step, as an uninterrupted one (so training runs in one process one after
another reproduce runs resumed in a fresh process); a finished sweep is not retrained; other
arguments, or a run whose config differs, are refused before anything is written."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runs import assert_same_lines, deterministic_lines, kill_at_metrics_line

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--set", "sft.steps=3", "--set", "grpo.steps=3", "--set", "eval.every=2", "--set", "grpo.skip_zero_advantage=false",
        "--set", "grpo.kl_coef=0.1", "--set", "run.progress=false"]
SWEEP = ["sweep", "configs/smoke.yaml", "--smoke", "--seeds", "0,1", *ARGS]
RUNS = ("smoke-s0", "smoke-s1")
LINES_PER_RUN = 8  # eval, 3 sft, eval, 3 rl (the eval at rl step 2 shares its line)


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "keel.cli", *SWEEP, "--out", str(out)]


def _summary(run: Path) -> dict:
    """summary.json without what differs between two identical runs: wall time and paths."""
    def clean(d):
        if isinstance(d, dict):
            return {k: clean(v) for k, v in d.items() if k not in ("run_dir", "wall_time_s") and not k.startswith(("time/", "mem/"))}
        return d

    return clean(json.loads((run / "summary.json").read_text()))


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "straight"
    r = subprocess.run(_cmd(out), cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in RUNS:
        assert len(deterministic_lines(out / name)) == LINES_PER_RUN, name
    return out


def test_the_straight_sweep_has_one_run_per_seed_and_a_comparison(straight):
    record = json.loads((straight / "sweep.json").read_text())
    assert record["presets"] == ["configs/smoke.yaml"] and record["seeds"] == [0, 1] and record["smoke"] is True
    assert record["overrides"] == ARGS[1::2]
    from keel.config import load_config

    assert [load_config(straight / n / "config.yaml").run.seed for n in RUNS] == [0, 1]
    assert deterministic_lines(straight / RUNS[0]) != deterministic_lines(straight / RUNS[1])  # the seed reached the run
    table = (straight / "compare.txt").read_text()
    assert all(name in table for name in RUNS) and "McNemar" in table
    html = (straight / "compare.html").read_text()
    assert "<table>" in html and all(name in html for name in RUNS)


@pytest.mark.parametrize("where", ["first run", "second run"])
def test_killed_sweep_continued_by_the_same_command_matches_the_uninterrupted_one(tmp_path, straight, where):
    # "first run": the rerun resumes smoke-s0, then trains smoke-s1 in the same process;
    # "second run": it skips the finished smoke-s0 and resumes smoke-s1
    killed = tmp_path / "killed"
    victim = killed / (RUNS[0] if where == "first run" else RUNS[1])
    cut = random.Random(os.getpid()).randint(2, LINES_PER_RUN - 2)
    proc = subprocess.Popen(_cmd(killed), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    kill_at_metrics_line(proc, victim / "metrics.jsonl", cut)
    assert proc.returncode == -signal.SIGKILL, f"the sweep finished before it could be killed (cut {cut})"
    assert not (killed / "compare.txt").exists()
    if where == "first run":
        assert not (killed / RUNS[1]).exists()  # runs go one after another

    r = subprocess.run(_cmd(killed), cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{victim}" in r.stdout and "continuing it" in r.stdout
    if where == "second run":
        assert "done already, skipped" in r.stdout
    for name in RUNS:
        assert_same_lines(deterministic_lines(killed / name), deterministic_lines(straight / name))
        assert _summary(killed / name) == _summary(straight / name), name
    table = (killed / "compare.txt").read_text()
    assert all(name in table for name in RUNS)
    assert (killed / "compare.html").exists()
    assert table.strip() in r.stdout  # the table also goes to stdout


def test_a_finished_sweep_is_not_retrained(straight, monkeypatch, capsys):
    from keel.cli import main

    monkeypatch.chdir(REPO)
    before = {name: _files(straight / name) for name in RUNS}
    assert main([*SWEEP, "--out", str(straight)]) == 0
    out = capsys.readouterr().out
    assert out.count("done already, skipped") == 2
    assert {name: _files(straight / name) for name in RUNS} == before  # metrics, checkpoints: untouched
    assert all(name in (straight / "compare.txt").read_text() for name in RUNS)


@pytest.mark.parametrize("change", [["--set", "grpo.kl_coef=0.2"], ["--seeds", "0,1,2"], ["--no-smoke"]])
def test_other_arguments_for_the_same_directory_are_refused_and_nothing_is_written(straight, monkeypatch, capsys, change):
    from keel.cli import main

    monkeypatch.chdir(REPO)
    args = [*SWEEP, "--out", str(straight)]
    if change == ["--no-smoke"]:
        args.remove("--smoke")
    elif change[0] == "--seeds":
        args[args.index("--seeds") + 1] = change[1]
    else:
        args += change
    before = _files(straight)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("keel: error: sweep:") and "holds a sweep with other" in err[0], err
    assert _files(straight) == before


def test_a_run_whose_config_differs_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    """sweep.json matches, but a run directory holds another config (e.g. the preset was edited)."""
    from keel.cli import main
    from keel.config import dump_yaml, load_config

    monkeypatch.chdir(REPO)
    out = tmp_path / "sweep"
    (out / RUNS[0]).mkdir(parents=True)
    record = {"presets": ["configs/smoke.yaml"], "seeds": [0, 1], "overrides": ARGS[1::2], "smoke": True}
    (out / "sweep.json").write_text(json.dumps(record))
    other = load_config("configs/smoke.yaml", [*ARGS[1::2], "grpo.kl_coef=0.3", "run.seed=0"], smoke=True)
    (out / RUNS[0] / "config.yaml").write_text(dump_yaml(other))
    before = _files(out)
    assert main([*SWEEP, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.yaml differs" in err[0] and "grpo.kl_coef is 0.3 there, 0.1 in this sweep" in err[0], err
    assert _files(out) == before

    foreign = tmp_path / "foreign"  # a non-empty directory that is not a sweep
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main([*SWEEP, "--out", str(foreign)]) == 2
    assert "not a sweep directory" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
