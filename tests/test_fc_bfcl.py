"""BFCL-V3 multi-turn env: oracle 100% on all 800 entries through parser + executor + bfcl-eval's
checker, null at BFCL's score, episode mechanics, isolation and memory, single-turn AST."""

from __future__ import annotations

import decimal
import time
import tracemalloc

import pytest

from keel.episode import run_text_episode
from keel.fc.bfcl import (
    BfclEnv,
    BfclEpisode,
    STEP_LIMIT,
    bfcl_check,
    cached_instance_count,
    gold_call_dicts,
    load_bfcl_multi_turn,
    load_bfcl_single_turn,
)
from keel.fc.learnable import generate_tasks
from keel.fc.policies import make_oracle, null_policy, run_fc_episode
from keel.types import ToolCall

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")


def _run(task, fmt, policy):
    return run_fc_episode(BfclEnv(fmt), task, policy, max_turns=len(task.gold_turns) * (STEP_LIMIT + 2))


@pytest.mark.parametrize("category", CATEGORIES)
def test_oracle_scores_100_percent_on_every_entry(category):
    tasks = load_bfcl_multi_turn(category)
    assert len(tasks) == 200
    failed = [t.id for t in tasks if not _run(t, "json", make_oracle("json"))[1]["checker_valid"]]
    assert failed == []
    assert cached_instance_count() == 0


@pytest.mark.parametrize("fmt", ["python", "python_tagged"])
def test_oracle_in_python_formats_on_a_sample(fmt):
    tasks = [t for c in CATEGORIES for t in load_bfcl_multi_turn(c, limit=15)]
    assert all(_run(t, fmt, make_oracle(fmt))[1]["checker_valid"] for t in tasks)


@pytest.mark.parametrize("category", CATEGORIES)
def test_null_policy_gets_what_bfcl_gives(category):
    # Every BFCL-V3 multi-turn entry has a non-empty gold turn, so a policy that never calls a
    # tool fails each entry with "empty turn": 0 / 200.
    tasks = load_bfcl_multi_turn(category, limit=40)
    infos = [_run(t, "json", null_policy)[1] for t in tasks]
    assert sum(i["checker_valid"] for i in infos) == 0
    assert {i["checker_error_type"] for i in infos} == {"multi_turn:empty_turn_model_response"}


def test_gold_turns_name_positional_arguments_and_keep_empty_turns():
    (task,) = load_bfcl_multi_turn("miss_func", ids=["multi_turn_miss_func_0"])
    # BFCL writes "sort('final_report.pdf')"; the simulator's signature names the argument.
    assert task.gold_turns[3] == [{"name": "sort", "arguments": {"file_name": "final_report.pdf"}}]
    assert task.gold_turns[2] == []  # the turn before the held-back `sort` doc arrives
    assert gold_call_dicts(["cd(folder='x')"], ["GorillaFileSystem"]) == [{"name": "cd", "arguments": {"folder": "x"}}]


def test_miss_func_serves_held_back_docs_at_the_right_turn():
    (task,) = load_bfcl_multi_turn("miss_func", ids=["multi_turn_miss_func_0"])
    env = BfclEnv("json")
    assert "sort" not in [t["function"]["name"] for t in env.tools(task)]
    ep = env.start(task)
    turns = [ep.next_user_message() for _ in range(5)]
    ep.close()
    # User turns 1, 2, then the held-back turn 3 (BFCL's entry has no user text there), then 4.
    assert turns[0].startswith("Perform a detailed search using grep")
    assert turns[1].startswith("Upon identifying")
    assert '"name": "sort"' in turns[2] and turns[2].endswith("I have updated some more functions you can choose from. What about now?")
    assert turns[3].startswith("Move 'previous_report.pdf'")
    assert turns[4] is None


def test_step_limit_force_quits_like_bfcl():
    (task,) = load_bfcl_multi_turn("base", limit=1)
    calls = []

    def always_pwd(t, messages):
        calls.append(1)
        return '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'

    ep, info = _run(task, "json", always_pwd)
    # Steps 1..21 run (BFCL quits after count > 20); the 22nd message's call is refused.
    ok_steps = [s for s in ep.steps if s.observation.ok]
    assert len(ok_steps) == STEP_LIMIT + 1 == 21
    assert ep.steps[21].observation.error == "step_limit"
    assert info["force_quit"] is True and info["checker_valid"] is False
    assert info["checker_error_type"] == "multi_turn:force_terminated"


def test_calls_without_begin_step_count_one_step_each_and_match_text_episode():
    # keel.episode.run_text_episode has no begin_step hook; the verdict must not change.
    tasks = load_bfcl_multi_turn("base", limit=10) + load_bfcl_multi_turn("miss_param", limit=10)
    for task in tasks:
        episodes = []
        env = BfclEnv("json")
        start = env.start
        env.start = lambda t: episodes.append(start(t)) or episodes[-1]
        run_text_episode(env, task, make_oracle("json"), max_turns=60)
        _, info = _run(task, "json", make_oracle("json"))
        assert episodes[0].info["checker_valid"] is info["checker_valid"] is True
        assert episodes[0].info["model_turn_calls"] != info["model_turn_calls"] or all(len(turn) <= 1 for turn in info["model_turn_calls"])


def test_execution_errors_and_refusals_are_observations():
    (task,) = load_bfcl_multi_turn("base", limit=1)
    ep = BfclEpisode(task)
    assert ep.execute(ToolCall("rm_rf", {})).error == "unknown_tool"
    assert ep.execute(ToolCall("cd", {"folder": float("inf")})).error == "bad_arguments"
    assert ep.execute(ToolCall("", {}, error="bad_json")).error == "bad_json"
    obs = ep.execute(ToolCall("cd", {"nonexistent_arg": 1}))
    assert obs.ok is False and obs.error == "tool_error" and obs.text.startswith("Error during execution")
    assert ep.execute(ToolCall("cd", {"folder": "document"})).text == '{"current_working_directory": "document"}'
    ep.close()
    assert ep.execute(ToolCall("ls", {})).error == "episode_over"
    assert cached_instance_count() == 0


def test_unbounded_math_is_refused_and_decimal_context_is_untouched():
    task = generate_tasks(1, seed=0, kinds=("math",))[0]
    ep = BfclEpisode(task)
    t0 = time.perf_counter()
    assert ep.execute(ToolCall("power", {"base": 10, "exponent": 10**15})).error == "argument_out_of_range"
    assert ep.execute(ToolCall("multiply", {"a": "x", "b": 10**12})).error == "argument_out_of_range"
    assert ep.execute(ToolCall("square_root", {"number": 2, "precision": 10**9})).error == "argument_out_of_range"
    assert time.perf_counter() - t0 < 1.0
    prec = decimal.getcontext().prec
    assert ep.execute(ToolCall("square_root", {"number": 2, "precision": 3})).text == '{"result": "1.41"}' or "1.41" in ep.execute(ToolCall("square_root", {"number": 2, "precision": 3})).text
    assert decimal.getcontext().prec == prec  # BFCL's square_root sets the global precision
    assert ep.execute(ToolCall("power", {"base": 2, "exponent": 10})).text == '{"result": 1024}'
    ep.close()


def test_bfcl_check_refuses_non_canonical_strings():
    (task,) = load_bfcl_multi_turn("base", limit=1)
    n = len(task.meta["ground_truth"])
    evil = [[["__import__('os').system('touch /tmp/keel_fc_pwned')"]]] + [[] for _ in range(n - 1)]
    assert bfcl_check(task, evil) == (False, {"error_type": "keel:non_canonical_call", "error_message": "refused to check \"__import__('os').system('touch /tmp/keel_fc_pwned')\""})
    spaced = [[["cd(folder = 'document')"]]] + [[] for _ in range(n - 1)]
    assert bfcl_check(task, spaced)[1]["error_type"] == "keel:non_canonical_call"
    assert bfcl_check(task, [[]])[1]["error_type"] == "multi_turn:force_terminated"


def test_memory_stays_flat_over_1000_episodes():
    tasks = generate_tasks(50, seed=3)
    oracle = make_oracle("json")
    for t in tasks[:20]:  # warm caches (imports, lru caches) before measuring
        _run(t, "json", oracle)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    valid = 0
    for i in range(1000):
        valid += _run(tasks[i % 50], "json", oracle)[1]["checker_valid"]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert valid == 1000
    assert cached_instance_count() == 0
    assert growth < 512 * 1024, f"{growth} bytes retained over 1000 episodes"


# ---------------------------------------------------------------------------------------------
# Single-turn AST categories

# Entries no answer can pass under bfcl-eval's own checker (BFCL data errors): a required
# parameter whose accepted-value list is empty (live_simple_106, _112), an answer naming a
# parameter the doc lacks (live_multiple_862 `journey_start_time`) or missing a required one
# (live_multiple_964 `statement`).
UNSOLVABLE = {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_862-181-3", "live_multiple_964-207-0"}


@pytest.mark.parametrize(
    "category,count",
    [("simple_python", 400), ("multiple", 200), ("parallel", 200), ("parallel_multiple", 200), ("irrelevance", 240),
     ("live_simple", 258), ("live_multiple", 1053), ("live_parallel", 16), ("live_parallel_multiple", 24), ("live_irrelevance", 884)],
)
def test_single_turn_oracle_and_null(category, count):
    from keel.fc.bfcl import BfclSingleTurnEnv

    tasks = load_bfcl_single_turn(category)
    assert len(tasks) == count
    env = BfclSingleTurnEnv("json")
    oracle_failed = {t.id for t in tasks if not run_fc_episode(env, t, make_oracle("json"), 3)[1]["checker_valid"]}
    assert oracle_failed == {i for i in UNSOLVABLE if i.startswith(category + "_")}
    null_valid = sum(run_fc_episode(env, t, null_policy, 3)[1]["checker_valid"] for t in tasks[:50])
    assert null_valid == (min(50, count) if "irrelevance" in category else 0)


def test_loader_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown BFCL multi-turn category 'composite'"):
        load_bfcl_multi_turn("composite")
    with pytest.raises(ValueError, match="unknown BFCL single-turn category"):
        load_bfcl_single_turn("simple_java")
