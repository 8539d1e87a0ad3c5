"""Run comparison: Wilson intervals and McNemar tests by hand, and compare_runs on fake runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from keel.compare import compare_runs, holm, mcnemar, mean_interval, read_eval, wilson_interval

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from make_run import make_run  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Wilson
# ---------------------------------------------------------------------------------------------


def test_wilson_17_of_40_by_hand():
    # p = 17/40 = 0.425, z = 1.959964, z² = 3.841459, z²/n = 0.0960365, 1 + z²/n = 1.0960365
    # centre = (0.425 + 3.841459/80) / 1.0960365 = (0.425 + 0.0480182) / 1.0960365 = 0.431571
    # p(1-p)/n = 0.244375/40 = 0.00610938; z²/4n² = 3.841459/6400 = 0.000600228; sum 0.00670960
    # half = (1.959964 / 1.0960365) · sqrt(0.00670960) = 1.788230 · 0.0819122 = 0.146478
    low, high = wilson_interval(17, 40)
    assert low == pytest.approx(0.431571 - 0.146478, abs=2e-6)  # 0.285093
    assert high == pytest.approx(0.431571 + 0.146478, abs=2e-6)  # 0.578049


def test_wilson_at_the_edges_by_hand():
    # 0 of 10: centre = (z²/20) / (1 + z²/10) = 0.192073 / 1.384146 = 0.138767,
    # half = z/1.384146 · sqrt(z²/400) = 1.415997 · 0.0979982 = 0.138767 → [0, 0.277534].
    low, high = wilson_interval(0, 10)
    assert low == 0.0
    assert high == pytest.approx(0.277534, abs=2e-6)
    # 10 of 10 mirrors it.
    low, high = wilson_interval(10, 10)
    assert (low, high) == (pytest.approx(1 - 0.277534, abs=2e-6), 1.0)


def test_wilson_bad_inputs():
    with pytest.raises(ValueError, match="n must be positive"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match=r"successes must be in \[0, n=5\], got 6"):
        wilson_interval(6, 5)


def test_mean_interval_by_hand():
    # values 1, 2, 3, 4: mean 2.5, sample sd = sqrt((2.25+0.25+0.25+2.25)/3) = sqrt(5/3) = 1.290994,
    # half = 1.959964 · 1.290994 / 2 = 1.265151.
    mean, low, high = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert (low, high) == (pytest.approx(2.5 - 1.265151, abs=1e-6), pytest.approx(2.5 + 1.265151, abs=1e-6))
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])


# ---------------------------------------------------------------------------------------------
# McNemar
# ---------------------------------------------------------------------------------------------


def test_mcnemar_exact_by_hand():
    # b=0, c=4: n=4, P[X ≤ 0] = 1/16, p = 2/16 = 0.125.
    r = mcnemar(0, 4)
    assert (r.method, r.p_value) == ("exact", 0.125)
    # b=1, c=5: n=6, P[X ≤ 1] = (1 + 6)/64 = 7/64, p = 14/64 = 0.21875.
    assert mcnemar(1, 5).p_value == 0.21875
    assert mcnemar(5, 1).p_value == 0.21875  # symmetric
    # b=3, c=3: P[X ≤ 3] = (1+6+15+20)/64 = 42/64, doubled 84/64 → capped at 1.
    assert mcnemar(3, 3).p_value == 1.0
    # b=2, c=10: n=12, P[X ≤ 2] = (1 + 12 + 66)/4096 = 79/4096, p = 158/4096 = 0.0385742.
    assert mcnemar(2, 10).p_value == pytest.approx(158 / 4096, abs=1e-12)
    # No discordant pairs: nothing to test.
    assert (mcnemar(0, 0).method, mcnemar(0, 0).p_value) == ("exact", 1.0)


def test_mcnemar_chi_square_by_hand():
    # b=10, c=20: n=30 ≥ 25 → χ² = (|10-20| - 1)² / 30 = 81/30 = 2.7; p = erfc(sqrt(1.35)) = 0.1003482
    # (the chi-square(1) survival function at 2.7).
    r = mcnemar(10, 20)
    assert r.method == "chi2_cc"
    assert r.statistic == pytest.approx(2.7)
    assert r.p_value == pytest.approx(0.1003482, abs=1e-6)
    # b = c = 15: |b-c| - 1 floored at 0 → χ² = 0, p = 1.
    assert mcnemar(15, 15).p_value == 1.0
    # The threshold is on b + c: 12 + 12 = 24 exact, 12 + 13 = 25 chi-square.
    assert mcnemar(12, 12).method == "exact" and mcnemar(12, 13).method == "chi2_cc"


def test_mcnemar_exact_and_chi_square_agree_for_many_discordant_pairs():
    # Equivalence of the two implementations where the approximation is good (n = 80..400).
    for b, c in [(30, 50), (100, 130), (180, 220), (40, 40)]:
        exact = mcnemar(b, c, exact_below=10_000)
        approx = mcnemar(b, c, exact_below=0)
        assert (exact.method, approx.method) == ("exact", "chi2_cc")
        assert exact.p_value == pytest.approx(approx.p_value, abs=0.01), (b, c, exact, approx)


def test_mcnemar_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar(-1, 3)


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 × (3, 2, 1) = 0.03, 0.06, 0.04 → running max 0.03, 0.06, 0.06.
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


# ---------------------------------------------------------------------------------------------
# Per-question files
# ---------------------------------------------------------------------------------------------


def write_eval(run: Path, step: int, rows: list[dict], tail: str = "") -> Path:
    (run / "eval").mkdir(parents=True, exist_ok=True)
    path = run / "eval" / f"step_{step:06d}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def test_read_eval_rejects_what_would_change_n(tmp_path):
    good = [{"task_id": "a", "em": 1, "f1": 0.5}, {"task_id": "b", "em": False, "f1": 0}]
    path = write_eval(tmp_path, 1, good, tail='{"task_id": "c", "em"')
    assert read_eval(path) == {"a": {"em": 1.0, "f1": 0.5}, "b": {"em": 0.0, "f1": 0.0}}  # torn tail tolerated
    cases = [
        ('{"task_id": "a", "em": 1}\nnot json\n{"task_id": "b", "em": 0}\n', r"step_000002.jsonl: step_000002.jsonl:2: not JSON"),
        ('{"task_id": "a", "em": 1}\n{"task_id": "a", "em": 0}\n', r"row 2: task_id 'a' appears twice"),
        ('{"em": 1}\n', r"row 1: missing task_id"),
        ('{"task_id": "a", "em": 0.5}\n', r"row 1: em must be 0 or 1"),
        ('{"task_id": "a", "em": 1, "f1": "high"}\n', r"row 1: f1 must be a finite number"),
        ("", r"no questions"),
    ]
    for text, message in cases:
        path = tmp_path / "eval" / "step_000002.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_eval(path)


# ---------------------------------------------------------------------------------------------
# compare_runs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("sweep")
    # peak EM 0.42 vs 0.52 on the same 40 questions; the fixture marks questions 0..k-1 correct.
    return [make_run(root / "r-selfv", seed=0, peak_em=0.42), make_run(root / "r-selfv-gate", seed=1, peak_em=0.52)]


def test_compare_at_peak_by_hand(two_runs, tmp_path):
    out = tmp_path / "compare.html"
    result = compare_runs(two_runs, out, at="peak")
    a, b = result["runs"]
    # Peak step 80 in both: round(0.42·40) = 17 and round(0.52·40) = 20.8 → 21 correct.
    assert (a["step"], b["step"], a["n"], b["n"]) == (80, 80, 40, 40)
    assert a["metrics"]["em"]["successes"] == 17 and b["metrics"]["em"]["successes"] == 21
    assert (a["metrics"]["em"]["low"], a["metrics"]["em"]["high"]) == wilson_interval(17, 40)
    em_test = next(t for t in result["tests"] if t["field"] == "em")
    # Nested correct sets (q < 17 vs q < 21): only B right on q = 17..20 → b=0, c=4 → p = 0.125.
    assert (em_test["b_only"], em_test["c_only"], em_test["method"], em_test["p_value"]) == (0, 4, "exact", 0.125)
    cvt_test = next(t for t in result["tests"] if t["field"] == "cvt")
    # CvT = correct and q % 3 != 0: B-only on q = 17, 19, 20 (18 is a multiple of 3) → p = 2/8.
    assert (cvt_test["b_only"], cvt_test["c_only"], cvt_test["p_value"]) == (0, 3, 0.25)
    # Holm over the two tests: sorted 0.125·2 = 0.25, 0.25·1 = 0.25.
    assert [t["p_holm"] for t in result["tests"]] == [0.25, 0.25]
    table = result["table"]
    assert "42.5 [28.5, 57.8]" in table  # the hand-computed Wilson interval, in percent
    assert "exact binomial" in table
    html = out.read_text()
    assert result["html"] == str(out)
    assert html.count('<svg class="chart"') == 8  # one overlay per metric in OVERLAY
    assert "r-selfv-gate" in html


def test_compare_final_and_explicit_step(two_runs):
    result = compare_runs(two_runs, at="final")
    # Step 120 is after the cliff: 0 of 40 correct in both → Wilson [0, 0.0876], no discordance.
    assert [r["step"] for r in result["runs"]] == [120, 120]
    assert result["runs"][0]["metrics"]["em"]["high"] == pytest.approx(wilson_interval(0, 40)[1])
    assert next(t for t in result["tests"] if t["field"] == "em")["p_value"] == 1.0
    assert [r["step"] for r in compare_runs(two_runs, at=40)["runs"]] == [40, 40]
    with pytest.raises(ValueError, match=r"no eval file for step 41"):
        compare_runs(two_runs, at=41)
    with pytest.raises(ValueError, match=r"at must be 'final', 'peak' or a step number"):
        compare_runs(two_runs, at="best")


def test_compare_reports_partial_overlap_and_references(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_eval(a, 10, [{"task_id": f"q{i}", "em": int(i < 6)} for i in range(10)])
    write_eval(b, 10, [{"task_id": f"q{i}", "em": int(i % 2 == 0)} for i in range(4, 12)])
    result = compare_runs([a, b], references={"paper B R-selfV": {"em": 0.395, "cvt": 0.0957}})
    t = next(t for t in result["tests"] if t["field"] == "em")
    # Shared q4..q9: A right on q4, q5; B right on q4, q6, q8 → only A: q5; only B: q6, q8.
    assert (t["n_common"], t["b_only"], t["c_only"]) == (6, 1, 2)
    # b=1, c=2: n=3, P[X ≤ 1] = (1 + 3)/8 = 0.5, doubled → 1.
    assert t["p_value"] == 1.0
    assert "a vs b share only part of their questions" in result["table"]
    assert "paper B R-selfV (reported)" in result["table"] and "39.5" in result["table"]
    assert [t["field"] for t in result["tests"]] == ["em"]  # no cvt in these files: no cvt test


def test_compare_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="no run directories"):
        compare_runs([])
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        compare_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no per-question eval files"):
        compare_runs([tmp_path / "empty"])
    with pytest.raises(ValueError, match="2 names for 1 runs"):
        write_eval(tmp_path / "one", 1, [{"task_id": "a", "em": 1}])
        compare_runs([tmp_path / "one"], names=["x", "y"])


def test_same_folder_names_are_told_apart(tmp_path):
    runs = []
    for seed in ("seed0", "seed1"):
        run = tmp_path / seed / "run"
        write_eval(run, 5, [{"task_id": "a", "em": 1}, {"task_id": "b", "em": 0}])
        runs.append(run)
    assert [r["name"] for r in compare_runs(runs)["runs"]] == ["seed0/run", "seed1/run"]


def test_html_escapes_run_names(tmp_path):
    run = tmp_path / "r"
    write_eval(run, 5, [{"task_id": "a", "em": 1}])
    result = compare_runs([run], tmp_path / "c.html", names=["<script>alert(1)</script>"])
    html = (tmp_path / "c.html").read_text()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert math.isclose(result["runs"][0]["metrics"]["em"]["mean"], 1.0)


def test_paired_lift_hand_computed():
    from keel.compare import paired_lift

    before = {f"q{i}": {"em": float(v)} for i, v in enumerate([1, 0, 0, 0, 1, 0, 0, 0, 0, 0])}
    after = {f"q{i}": {"em": float(v)} for i, v in enumerate([1, 1, 1, 1, 0, 1, 1, 1, 1, 0])}
    after["extra"] = {"em": 1.0}  # only questions both evaluated count
    lift = paired_lift(before, after)
    assert (lift["gained"], lift["lost"], lift["n"]) == (7, 1, 10)
    assert abs(lift["lift"] - 0.6) < 1e-12 and abs(lift["before"] - 0.2) < 1e-12 and abs(lift["after"] - 0.8) < 1e-12
    assert lift["p_value"] == 18 / 256  # 2·P[X ≤ 1], X ~ Bin(8, ½)
    many = paired_lift({str(i): {"em": 0.0} for i in range(40)}, {str(i): {"em": float(i < 30)} for i in range(40)})
    assert many["gained"] == 30 and many["p_value"] == 2 / 2**30  # exact binomial, not chi-square, at 30 discordant pairs


def test_compare_figures_are_the_pages_curves_as_svg_files(two_runs, tmp_path):
    import xml.etree.ElementTree as ET

    import keel.cli

    assert keel.cli.main(["compare", *map(str, two_runs), "--out", str(tmp_path / "c.html"), "--figures", str(tmp_path / "fig")]) == 0
    names = sorted(p.name for p in (tmp_path / "fig").iterdir())
    assert "compare-dev-em.svg" in names and "compare-kl-mean.svg" in names
    page = (tmp_path / "c.html").read_text()
    assert len(names) == page.count('<svg class="chart"')  # every chart of the page, no more
    texts = [t.text for t in ET.parse(tmp_path / "fig" / "compare-dev-em.svg").getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert {"r-selfv", "r-selfv-gate"} <= set(texts)  # the legend names the runs


# ---------------------------------------------------------------------------------------------
# Arms: seeds of one setting pooled
# ---------------------------------------------------------------------------------------------


def pooled_run(root: Path, name: str, reward: str, seed: int, em: list[int], threads: int = 2) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"reward:\n  name: {reward}\nrun:\n  seed: {seed}\n  threads: {threads}\n")
    write_eval(run, 8, [{"task_id": f"q{i}", "em": v} for i, v in enumerate(em, start=1)])
    return run


def test_arms_pool_seeds_and_pair_by_seed_by_hand(tmp_path):
    runs = [
        pooled_run(tmp_path, "ra-s0", "r1", 0, [1, 1, 0, 0]),
        pooled_run(tmp_path, "ra-s1", "r1", 1, [1, 0, 1, 0], threads=1),  # run.* other than the seed: same arm
        pooled_run(tmp_path, "rb-s0", "r2", 0, [0, 1, 1, 0]),
        pooled_run(tmp_path, "rb-s1", "r2", 1, [1, 1, 1, 1]),
        pooled_run(tmp_path, "rc-s1", "r3", 1, [0, 0, 0, 0]),
        pooled_run(tmp_path, "rc-s2", "r3", 2, [1, 1, 1, 1]),
    ]
    result = compare_runs(runs, tmp_path / "compare.html", pool=True)
    assert result["tests"] == []  # no run-against-run tests when pooling
    arms = {a["name"]: a for a in result["arms"]}
    assert sorted(arms) == ["ra", "rb", "rc"]
    assert [arms[n]["seeds"] for n in ("ra", "rb", "rc")] == [[0, 1], [0, 1], [1, 2]]
    assert [(arms[n]["metrics"]["em"]["successes"], arms[n]["n"]) for n in ("ra", "rb", "rc")] == [(4, 8), (6, 8), (4, 8)]
    assert (arms["rb"]["metrics"]["em"]["low"], arms["rb"]["metrics"]["em"]["high"]) == wilson_interval(6, 8)
    assert arms["ra"]["settings"] == {"reward.name": "r1"}
    tests = {(t["a"], t["b"]): t for t in result["arm_tests"]}
    assert list(tests) == [("ra", "rb"), ("ra", "rc"), ("rb", "rc")]  # em only: the records have no cvt
    # ra vs rb, seeds 0 and 1: seed 0 only ra q1, only rb q3; seed 1 only rb q2, q4 → 1 / 3 of 8 pairs;
    # exact: 2·P[X ≤ 1], X ~ Bin(4, ½) = 2·5/16
    ab = tests[("ra", "rb")]
    assert (ab["seeds"], ab["n_common"], ab["b_only"], ab["c_only"], ab["method"]) == ([0, 1], 8, 1, 3, "exact")
    assert ab["p_value"] == pytest.approx(0.625)
    # ra vs rc share seed 1 only: 2 / 0 → 2·(1/4); rb vs rc: 4 / 0 → 2·(1/16)
    assert (tests[("ra", "rc")]["seeds"], tests[("ra", "rc")]["b_only"], tests[("ra", "rc")]["c_only"]) == ([1], 2, 0)
    assert [tests[k]["p_value"] for k in [("ra", "rc"), ("rb", "rc")]] == pytest.approx([0.5, 0.125])
    # Holm over the three: 0.125·3 = 0.375, 0.5·2 = 1, 0.625·1 → running max 0.375, 1, 1
    assert [tests[k]["p_holm"] for k in tests] == pytest.approx([1.0, 1.0, 0.375])
    assert "Arms (runs whose configs differ only in run.*" in result["table"] and "reward.name=r2" in result["table"]
    assert "McNemar tests between arms" in (tmp_path / "compare.html").read_text()
    assert "note: not tested" not in result["table"]  # every pair of arms shares a seed
    solo = pooled_run(tmp_path, "rd-s5", "r4", 5, [1, 1, 1, 1])
    assert "note: not tested, no seed in common: ra and rd; rb and rd; rc and rd" in compare_runs([*runs, solo], pool=True)["table"]


def test_arms_refuse_two_runs_of_one_seed_and_a_run_without_config(tmp_path):
    a = pooled_run(tmp_path, "x-s0", "r1", 0, [1, 0])
    b = pooled_run(tmp_path / "again", "x-s0", "r1", 0, [0, 0])
    with pytest.raises(ValueError, match=r"same setting and seed 0; an arm pairs its runs"):
        compare_runs([a, b], pool=True)
    (b / "config.yaml").unlink()
    with pytest.raises(ValueError, match=r"again/x-s0/config.yaml is missing"):
        compare_runs([a, b], pool=True)


def test_compare_pool_on_the_command_line(tmp_path, capsys):
    from keel.cli import main

    runs = [pooled_run(tmp_path, f"{r}-s{s}", r, s, em) for r, s, em in
            [("p", 0, [1, 1]), ("p", 1, [1, 0]), ("q", 0, [0, 0]), ("q", 1, [0, 0])]]
    assert main(["compare", *map(str, runs), "--pool"]) == 0
    out = capsys.readouterr().out
    assert "3/4" in out and "0/4" in out  # p: 3 of 4 question-answers, q: none
    rows = [[c for c in line.split("  ") if c.strip()] for line in out.splitlines()]
    # p right on 3 (seed, question) pairs q missed, q on none: exact 2·P[X ≤ 0], X ~ Bin(3, ½) = 0.25
    assert [c.strip() for c in rows[-1]] == ["p", "q", "em", "0,1", "4", "3", "0", "exact binomial", "0.000", "0.25", "0.25"]


def test_a_sweep_of_several_presets_and_seeds_pools_each_preset(tmp_path, capsys):
    from keel.sweep import PlannedRun, _run_all

    spec = [("a", "r1", 0, [1, 1]), ("a", "r1", 1, [1, 0]), ("b", "r2", 0, [0, 1]), ("b", "r2", 1, [0, 0])]
    runs = [PlannedRun(f"{p}-s{s}", f"configs/{p}.yaml", s, None, state="done") for p, _, s, _ in spec]
    for p, reward, s, em in spec:
        pooled_run(tmp_path, f"{p}-s{s}", reward, s, em)
    assert _run_all(tmp_path, runs, again="keel sweep ...") == 0
    table = (tmp_path / "compare.txt").read_text()
    assert "Arms (runs whose configs differ only in run.*" in table and "3/4" in table and "1/4" in table
    # presets that differ only in run.* cannot be arms: the sweep compares run against run instead
    for name in ("b-s0", "b-s1"):
        (tmp_path / name / "config.yaml").write_text(f"reward:\n  name: r1\nrun:\n  seed: {name[-1]}\n  threads: 1\n")
    (tmp_path / "compare.txt").unlink()
    assert _run_all(tmp_path, runs, again="keel sweep ...") == 0
    assert "seeds not pooled" in capsys.readouterr().out
    assert "Arms" not in (tmp_path / "compare.txt").read_text()


def test_arms_read_configs_as_this_version_does(tmp_path):
    # a run made before a key existed (here: no detectors section) and one that writes the key's
    # default are one setting: the missing key takes its default
    old = pooled_run(tmp_path, "main-s0", "r_binary", 0, [1, 0])
    new = pooled_run(tmp_path / "later", "main-s1", "r_binary", 1, [1, 1])
    (new / "config.yaml").write_text("reward:\n  name: r_binary\ndetectors:\n  kl_spike:\n    min_tag_kl: 0.05\nrun:\n  seed: 1\n")
    other = pooled_run(tmp_path, "selfv-s0", "r_selfv", 0, [0, 0])
    arms = compare_runs([old, new, other], pool=True)["arms"]
    assert [(a["name"], a["seeds"], a["settings"]) for a in arms] == [("main", [0, 1], {"reward.name": "r_binary"}),
                                                                      ("selfv", [0], {"reward.name": "r_selfv"})]


# ---------------------------------------------------------------------------------------------
# Curves against RL steps
# ---------------------------------------------------------------------------------------------


def test_rl_axis_by_hand(tmp_path):
    from keel.compare import _on_rl_axis
    from keel.report import rl_steps

    rows = [{"step": 0, "phase": "eval"}, {"step": 1, "phase": "rl"}, {"step": 2, "phase": "rl"}, {"step": 3, "phase": "sft"},
            {"step": 4, "phase": "sft"}, {"step": 5, "phase": "rl"}, {"step": 4, "phase": "sft"}]
    assert rl_steps(rows) == {0: 0, 1: 1, 2: 2, 3: None, 4: None, 5: 3}
    assert rl_steps([{"step": 1, "phase": "sft"}, {"step": 1, "phase": "rl"}]) == {1: 1}  # a re-logged step keeps its later line
    placed = _on_rl_axis([(0, 0.6), (2, 0.4), (3, 9.0), (5, 0.5), (7, 0.7)], {0: 0, 1: 1, 2: 2, 3: None, 5: 3})
    assert placed == [(0, 0.6), (2, 0.4), (3, 0.5), (3, 0.7)]


def test_compare_on_the_rl_axis_writes_its_figures(tmp_path):
    import keel.cli

    runs = []
    for name, phases in [("plain", ["eval", "rl", "rl", "rl"]), ("phased", ["eval", "rl", "sft", "sft", "rl", "rl"])]:
        run = tmp_path / name
        run.mkdir()
        lines = [{"step": i, "phase": p, "reward/mean": 0.1 * i} for i, p in enumerate(phases)]
        lines[-1]["eval/em"] = 0.5
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        write_eval(run, len(phases) - 1, [{"task_id": "q1", "em": 1}, {"task_id": "q2", "em": 0}])
        runs.append(run)
    assert keel.cli.main(["compare", *map(str, runs), "--rl-axis", "--out", str(tmp_path / "c.html"), "--figures", str(tmp_path / "fig")]) == 0
    assert "compare-dev-em-x-rl-steps.svg" in {p.name for p in (tmp_path / "fig").iterdir()}
    assert "dev EM (x: RL steps)" in (tmp_path / "c.html").read_text()
    from keel.report import load_run

    assert [load_run(r).rl_step for r in runs] == [{0: 0, 1: 1, 2: 2, 3: 3}, {0: 0, 1: 1, 2: None, 3: None, 4: 2, 5: 3}]
