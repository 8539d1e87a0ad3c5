"""examples/sql_tools: the worked example a user copies — its data, its three tool sources
(Python functions, tools.json + dispatcher, MCP server) and its presets through the real CLI."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "sql_tools"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


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


def _train(tmp_path, name, *args):
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "keel.cli", "train", *args, "--out", str(out), "--set", "run.progress=false"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("preset", ["preset.yaml", "preset_mcp.yaml"])
def test_example_presets_run_with_smoke_through_the_cli(tmp_path, preset):
    # OPS puts gold members in every group, so the RL loop's tool path runs even on the random tiny model
    out = _train(tmp_path, "run", f"examples/sql_tools/{preset}", "--smoke", "--set", "signals.ops.enabled=true", "--set", "signals.ops.members=1")
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
    out = _train(tmp_path, "run", "examples/sql_tools/preset_mcp.yaml", "--smoke", "--set", f"env.mcp_command=[python, {server}, {starts}]",
                 "--set", f"data.train={data}", "--set", f"data.dev={data}", "--set", "env.call_timeout_s=1.0",
                 "--set", "signals.ops.enabled=true", "--set", "signals.ops.members=1", "--set", "rollout.prompts_per_step=1")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_gold_failed"] == 2 and "eval_final" in summary
    assert len(starts.read_text().splitlines()) >= 3  # started, and restarted after the hang and after the crash
