"""env.kind mcp: a real MCP server (the official SDK) over stdio; hung and crashing servers are
structured errors and a restart; the MCP path gives the same trajectories as the Python path."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from keel.tools.env import ToolsEnv
from keel.tools.mcp import MCPError, MCPTools
from keel.types import Task, ToolCall

REPO = Path(__file__).resolve().parent.parent
FAULTY = str(Path(__file__).parent / "fixtures" / "mcp_faulty_server.py")
TASK = Task(id="t", question="q", answers=[])

pytestmark = pytest.mark.timeout(180)


def _starts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_hung_server_is_a_timeout_answer_and_a_restart(tmp_path):
    starts = tmp_path / "starts"
    backend = MCPTools(["python", FAULTY, str(starts)], timeout_s=1.0)
    try:
        env = ToolsEnv(backend, call_timeout_s=1.0, name="mcp")
        assert [t["function"]["name"] for t in env.tools(TASK)] == ["echo", "hang", "crash", "refuse"]
        ep = env.start(TASK)
        assert ep.execute(ToolCall("echo", {"text": "a"})).text == "echo: a"
        t0 = time.time()
        obs = ep.execute(ToolCall("hang", {}))
        took = time.time() - t0
        assert (obs.text, obs.ok, obs.error) == ("Error: TimeoutError: hang took longer than 1 s; the tool server was restarted.", False, "timeout")
        assert took < 20, took  # 1 s timeout + the SDK's bounded shutdown + a restart
        assert ep.execute(ToolCall("echo", {"text": "b"})).text == "echo: b"  # the run goes on
        assert (backend.restarts, _starts(starts)) == (1, 2)
        ep.close()
    finally:
        backend.close()


def test_crashed_server_is_a_structured_error_and_a_restart(tmp_path):
    starts = tmp_path / "starts"
    backend = MCPTools(["python", FAULTY, str(starts)], timeout_s=5.0)
    try:
        ep = ToolsEnv(backend, call_timeout_s=5.0, name="mcp").start(TASK)
        obs = ep.execute(ToolCall("crash", {}))
        assert obs.text.startswith("Error: the tool server failed (") and obs.text.endswith("); it was restarted.")
        assert (obs.ok, obs.error) == (False, "server_error")
        assert ep.execute(ToolCall("echo", {"text": "c"})).text == "echo: c"
        refused = ep.execute(ToolCall("refuse", {}))  # an error result of the server is the tool's error answer
        assert (refused.text, refused.error) == ("Error: PermissionError: not allowed", "tool_exception")
        # Keel's own checks run before anything is sent: the server never sees a bad call
        assert ep.execute(ToolCall("echo", {"text": 3})).text == "Error: bad arguments for echo: text: 3 is not of type 'string'"
        assert (backend.restarts, _starts(starts)) == (1, 2)
    finally:
        backend.close()


def test_a_server_that_does_not_start_is_a_one_line_error():
    with pytest.raises(MCPError, match=r"the server did not start"):
        MCPTools(["python", "-c", "import sys; sys.exit(1)"], timeout_s=1.0)


# --- the same example on both paths ------------------------------------------------------------


def _envs(*extra):
    from keel import tasks as task_builder
    from keel.config import load_config

    common = ["data.source=jsonl", "data.train=examples/sql_tools/train.jsonl", "data.dev=examples/sql_tools/dev.jsonl"]
    py = load_config(REPO / "examples/sql_tools/preset.yaml", [*common, *extra])
    mcp = load_config(REPO / "examples/sql_tools/preset_mcp.yaml", [*common, *extra])
    return task_builder.build(py), task_builder.build(mcp)


@pytest.fixture(scope="module")
def both(request):
    import os

    cwd = os.getcwd()
    os.chdir(REPO)  # the presets' paths are relative to the repository root
    try:
        (py_env, train, dev), (mcp_env, train2, dev2) = _envs()
    finally:
        os.chdir(cwd)
    assert [t.id for t in train] == [t.id for t in train2]
    yield py_env, mcp_env, train + dev
    mcp_env.close()


WRONG_TURNS = [  # what an untrained policy writes: failing SQL, a refused statement, bad arguments, an unknown tool
    '<tool_call>\n{"name": "run_sql", "arguments": {"query": "SELECT nope FROM customers"}}\n</tool_call>',
    '<tool_call>\n{"name": "run_sql", "arguments": {"query": "DELETE FROM orders"}}\n</tool_call>\n<tool_call>\n{"name": "describe_table", "arguments": {"table": "orders"}}\n</tool_call>',
    '<tool_call>\n{"name": "run_sql", "arguments": {"sql": "SELECT 1"}}\n</tool_call><tool_call>{"name": "list_tables", "arguments": {}}</tool_call>',
    '<answer>42</answer>',
]


def test_mcp_and_python_paths_give_the_same_text_episodes(both):
    from keel.episode import run_text_episode
    from keel.sft import gold_turn_texts

    py_env, mcp_env, tasks = both
    assert py_env.tools(tasks[0]) == mcp_env.tools(tasks[0])  # same listing, hence the same prompt

    def oracle(task, messages):
        return gold_turn_texts(task)[sum(m["role"] == "assistant" for m in messages)]

    def wrong(task, messages):
        return WRONG_TURNS[sum(m["role"] == "assistant" for m in messages)]

    for policy in (oracle, wrong):
        for task in tasks:
            a = run_text_episode(py_env, task, policy, 5).to_trajectory().to_dict()
            b = run_text_episode(mcp_env, task, policy, 5).to_trajectory().to_dict()
            assert a == b, task.id
    # the wrong policy reached every kind of answer on both paths
    errors = {s.observation.error for s in run_text_episode(mcp_env, tasks[0], wrong, 5).steps}
    assert errors == {"tool_exception", None, "bad_arguments"}


def test_mcp_and_python_paths_give_the_same_model_rollouts(both, tiny):
    """Token-in/token-out on both paths: the tiny model is steered into the gold and the wrong
    turns; ids, sources, log-probs and steps must be identical."""
    from keel.chat import IM_END
    from keel.rollout import SamplingParams, rollout
    from keel.sft import gold_turn_texts

    model, tok = tiny
    py_env, mcp_env, tasks = both
    batch = [t for t in tasks if t.meta["fields"]["kind"] == "two_step"][:2] + tasks[:2]
    eos = tok.convert_tokens_to_ids(IM_END)
    texts = [gold_turn_texts(t) for t in batch[:2]] + [WRONG_TURNS, WRONG_TURNS]

    def steer(row, turn):
        return tok.encode(texts[row][turn], add_special_tokens=False) + [eos]

    params = SamplingParams(max_turns=4, max_new_tokens=96, max_total_tokens=4096)
    a = rollout(model, tok, py_env, batch, params, generator=torch.Generator().manual_seed(0), steer=steer)
    b = rollout(model, tok, mcp_env, batch, params, generator=torch.Generator().manual_seed(0), steer=steer)
    timing = ("rollout_s", "prefill_s", "append_s")  # wall-clock seconds in info, the only difference allowed
    for x in a + b:
        assert set(x.info) == set(timing)
        x.info = {}
    assert [x.to_dict() for x in a] == [x.to_dict() for x in b]
    assert [x.answer for x in a] == [batch[0].answers[0], batch[1].answers[0], "42", "42"]
    assert sum(len(x.steps) for x in a) == 2 + 2 + 2 * 5
