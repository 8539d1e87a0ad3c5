"""examples/sql_tools: the worked example a user copies — its data, its three tool sources
(Python functions, tools.json + dispatcher, MCP server) and its presets through the real CLI."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from runs import train_cli

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "sql_tools"


@pytest.fixture
def in_repo():
    cwd = os.getcwd()
    os.chdir(REPO)  # the presets' paths are relative to the repository root
    yield
    os.chdir(cwd)


def _build(*overrides, preset="preset.yaml"):
    from keel import tasks as task_builder
    from keel.config import load_config

    return task_builder.build(load_config(EXAMPLE / preset, list(overrides)))


def _oracle(task, messages):
    from keel.sft import gold_turn_texts

    return gold_turn_texts(task)[sum(m["role"] == "assistant" for m in messages)]


def test_the_generator_reproduces_the_committed_data(tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import make_db
    finally:
        sys.path.pop(0)
    make_db.main(tmp_path)
    for name in ("train.jsonl", "dev.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / name).read_text(), name
    dump = lambda p: list(sqlite3.connect(p).iterdump())  # noqa: E731
    assert dump(tmp_path / "shop.db") == dump(EXAMPLE / "shop.db")


def test_oracle_answers_every_question_through_the_env(in_repo):
    from keel.evaluate import evaluate_text_policy

    env, train, dev = _build()
    assert (len(train), len(dev)) == (92, 20)
    means, rows, _ = evaluate_text_policy(env, train + dev, _oracle, 5)
    # 40 two-step questions (2 calls each) and 72 one-call questions: (80 + 72) / 112 calls per question
    assert means["eval/em"] == 1.0 and means["eval/n"] == 112.0
    assert means["eval/tools_per_question"] == pytest.approx(152 / 112)


def test_tools_json_and_the_dispatcher_are_the_python_tools(in_repo):
    from keel.episode import run_text_episode

    py_env, train, dev = _build()
    schema_env, _, _ = _build("env.tools_file=", "env.tools_schema=examples/sql_tools/tools.json", "env.dispatcher=examples/sql_tools/dispatch.py:dispatch")
    assert json.loads((EXAMPLE / "tools.json").read_text()) == py_env.tools(train[0]) == schema_env.tools(train[0])
    bad = lambda task, messages: ['<tool_call>{"name": "run_sql", "arguments": {"query": "SELECT x FROM y"}}</tool_call>',  # noqa: E731
                                  '<tool_call>{"name": "run_sql", "arguments": {}}</tool_call>', "<answer>?</answer>"][len(messages) // 2 - 1]
    for policy in (_oracle, bad):
        for task in train[:30] + dev:
            a = run_text_episode(py_env, task, policy, 4).to_trajectory().to_dict()
            b = run_text_episode(schema_env, task, policy, 4).to_trajectory().to_dict()
            assert a == b, task.id
    steps = run_text_episode(schema_env, dev[0], bad, 4).steps
    assert [s.observation.text for s in steps] == ["Error: OperationalError: no such table: y", "Error: bad arguments for run_sql: 'query' is a required property"]


@pytest.mark.parametrize("preset", ["preset.yaml", "preset_mcp.yaml"])
def test_example_presets_run_with_smoke_through_the_cli(tmp_path, preset):
    # OPS puts gold members in every group, so the RL loop's tool path runs even on the random tiny model
    out = train_cli(tmp_path, "run", f"examples/sql_tools/{preset}", "--smoke", "--set", "signals.ops.enabled=true", "--set", "signals.ops.members=1")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if x.get("phase") == "rl") == 2 and all("signal/ops_members" in x for x in lines if x.get("phase") == "rl")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_gold_failed"] == 0 and summary["n_train"] == 92 and "eval_final" in summary
    assert (out / "report.html").exists()


def test_training_survives_a_hung_and_a_crashing_mcp_server(tmp_path):
    """The gold calls of two of the three tasks hang or kill the server: every replay of them is a
    structured error and a restart, and the run finishes."""
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": "hang", "answer": "x", "gold_calls": [[{"name": "hang", "arguments": {}}]]}) + "\n"
                    + json.dumps({"prompt": "crash", "answer": "x", "gold_calls": [[{"name": "crash", "arguments": {}}], [{"name": "echo", "arguments": {"text": "x"}}]]}) + "\n"
                    + json.dumps({"prompt": "echo", "answer": "x", "gold_calls": [[{"name": "echo", "arguments": {"text": "x"}}]]}) + "\n")
    starts = tmp_path / "starts"
    server = str(REPO / "tests" / "fixtures" / "mcp_faulty_server.py")
    out = train_cli(tmp_path, "run", "examples/sql_tools/preset_mcp.yaml", "--smoke", "--set", f"env.mcp_command=[python, {server}, {starts}]",
                 "--set", f"data.train={data}", "--set", f"data.dev={data}", "--set", "env.call_timeout_s=1.0",
                 "--set", "signals.ops.enabled=true", "--set", "signals.ops.members=1", "--set", "rollout.prompts_per_step=1")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_gold_failed"] == 2 and "eval_final" in summary
    assert len(starts.read_text().splitlines()) >= 3  # started, and restarted after the hang and after the crash


def _eval(tmp_path, name, *args):
    from keel.cli import main

    out = tmp_path / name
    assert main(["eval", *args, "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text()), [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def test_eval_config_on_the_example(tmp_path, in_repo, capsys):
    oracle, rows = _eval(tmp_path, "oracle", "--config", "examples/sql_tools/preset.yaml", "--policy", "oracle")
    assert (oracle["eval/em"], oracle["n"], len(rows), oracle["env"], oracle["split"]) == (1.0, 20, 20, "tools", "dev")
    null, _ = _eval(tmp_path, "null", "--config", "examples/sql_tools/preset.yaml", "--policy", "null")
    assert (null["eval/em"], null["eval/tools_per_question"]) == (0.0, 0.0)
    mcp, _ = _eval(tmp_path, "mcp", "--config", "examples/sql_tools/preset_mcp.yaml", "--policy", "oracle", "--split", "train", "--limit", "10")
    assert (mcp["eval/em"], mcp["n"], mcp["env"]) == (1.0, 10, "mcp")
    tiny, rows = _eval(tmp_path, "tiny", "--config", "examples/sql_tools/preset.yaml", "--policy", "tiny", "--limit", "2", "--set", "eval.max_new_tokens=8")
    assert tiny["n"] == 2 and len(rows) == 2


def test_eval_config_on_the_built_in_envs(tmp_path, in_repo):
    kg, _ = _eval(tmp_path, "kg", "--config", "configs/smoke.yaml", "--policy", "oracle", "--max-turns", "8")  # smoke.yaml allows 2 turns
    assert kg["eval/em"] == 1.0 and kg["env"] == "kg" and kg["n"] == 4 and "errors" in kg
    fc, _ = _eval(tmp_path, "fc", "--config", "configs/fc_smoke.yaml", "--policy", "oracle")
    assert fc["eval/em"] == 1.0 and fc["env"] == "fc_learn" and fc["n"] == 4 and fc["call_format"] == "json"
    assert fc["em_by_kind"] == {"fc_learn_fs": {"em": 1.0, "n": 2}, "fc_learn_math": {"em": 1.0, "n": 2}}
    # format-OOD: the same dev tasks with calls written as Python lists (the oracle writes them too)
    py, _ = _eval(tmp_path, "fc_py", "--config", "configs/fc_smoke.yaml", "--policy", "oracle", "--set", "env.call_format=python")
    assert (py["eval/em"], py["call_format"], py["n"]) == (1.0, "python", 4)
    fc_null, _ = _eval(tmp_path, "fc_null", "--config", "configs/fc_smoke.yaml", "--policy", "null")
    assert fc_null["eval/em"] == 0.0


def test_eval_config_oracle_without_gold_is_refused(tmp_path, in_repo, capsys):
    from keel.cli import main

    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"prompt": "How many customers live in Lyon?", "answer": "5"}) + "\n")
    code = main(["eval", "--config", "examples/sql_tools/preset.yaml", "--set", f"data.train={data}", "--set", f"data.dev={data}",
                 "--policy", "oracle", "--out", str(tmp_path / "x")])
    assert code == 2 and "eval --policy oracle replays gold_calls, but task 't-1' (and 0 more) has none" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
