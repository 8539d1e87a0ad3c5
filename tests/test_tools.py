"""env.kind tools: schemas, validation before execution, timeouts, output cap, per-episode state,
hostile model output, JSONL tasks and user rewards (issue 15)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.tools.env import ToolsEnv
from keel.tools.python import ToolLoadError, build_python_backend
from keel.tools.schema import function_schema
from keel.types import Observation, Step, Task, ToolCall, Trajectory

FIXTURES = Path(__file__).parent / "fixtures"
TOOLS_FILE = str(FIXTURES / "user_tools.py")
TASK = Task(id="t0", question="q", answers=["7"])


@pytest.fixture
def user_tools():
    from keel.tools.python import load_module

    mod = load_module(TOOLS_FILE)
    mod.CALLS.clear(), mod.VIOLATIONS.clear(), mod.STATES.clear()
    return mod


def make_env(timeout: float = 5.0, cap: int = 2000) -> ToolsEnv:
    return ToolsEnv(build_python_backend([], TOOLS_FILE, "", "", ""), call_timeout_s=timeout, max_output_chars=cap)


def test_schema_from_hints_and_docstring_without_state(user_tools):
    assert function_schema(user_tools.add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first number"},
                                                         "b": {"type": "integer", "description": "the second number"}},
                       "required": ["a", "b"]}}}
    env = make_env()
    # every public function of the file, in source order; make_state and _private are not tools
    assert [t["function"]["name"] for t in env.tools(TASK)] == ["add", "greet", "tag", "fail", "nap", "big"]
    greet = env.tools(TASK)[1]["function"]["parameters"]
    assert greet["properties"]["loud"] == {"type": "boolean", "nullable": True, "description": "shout it"} and greet["required"] == ["name"]


@pytest.mark.parametrize("call, text", [
    (ToolCall("add", {"a": 1}), "Error: bad arguments for add: 'b' is a required property"),
    (ToolCall("add", {"a": 1, "b": "2"}), "Error: bad arguments for add: b: '2' is not of type 'integer'"),
    (ToolCall("add", {"a": 1, "b": True}), "Error: bad arguments for add: b: True is not of type 'integer'"),
    (ToolCall("add", {"a": 1, "b": 2.0}), "Error: bad arguments for add: b: 2.0 is not of type 'integer'"),  # JSON Schema alone would accept 2.0
    (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "Error: bad arguments for add: Additional properties are not allowed ('c' was unexpected)"),
    (ToolCall("add", {"a": 1, "b": 2, "state": 3}), "Error: bad arguments for add: Additional properties are not allowed ('state' was unexpected)"),
    (ToolCall("tag", {"words": ["a", 1], "mode": "upper"}), "Error: bad arguments for tag: words.1: 1 is not of type 'string'"),
    (ToolCall("tag", {"words": [], "mode": "title"}), "Error: bad arguments for tag: mode: 'title' is not one of ['upper', 'lower']"),
    (ToolCall("nope", {}), "Error: unknown tool 'nope'; the tools are add, greet, tag, fail, nap, big."),
    (ToolCall("", {}, error="bad_json"), "Error: the call could not be parsed (bad_json)."),
])
def test_invalid_calls_are_answered_and_never_run(user_tools, call, text):
    ep = make_env().start(TASK)
    obs = ep.execute(call)
    ep.close()
    assert (obs.text, obs.ok) == (text, False)
    assert user_tools.CALLS == [] and user_tools.STATES == []  # not even the state was made


def test_valid_calls_nullable_results_and_exceptions(user_tools):
    ep = make_env().start(TASK)
    assert ep.execute(ToolCall("add", {"a": 3, "b": 4})).text == "7"  # an int is JSON-encoded
    assert ep.execute(ToolCall("greet", {"name": "Ada", "loud": None})).text == "hello Ada"  # nullable: null allowed
    assert ep.execute(ToolCall("tag", {"words": ["a", "B"], "mode": "upper"})).text == '["A", "B"]'
    obs = ep.execute(ToolCall("fail", {"message": "bad\nthing"}))
    assert (obs.text, obs.ok, obs.error) == ("Error: ValueError: bad thing", False, "tool_exception")  # one line
    ep.close()
    assert [c[0] for c in user_tools.CALLS] == ["add", "greet", "tag", "fail"]


def test_a_result_json_cannot_encode_is_the_tool_s_error_answer():
    """json.dumps(default=str) still raises on tuple keys (TypeError), a structure that holds
    itself (ValueError) and deep nesting (RecursionError): each is that call's failed answer,
    as an exception inside the tool is, and the episode goes on."""
    from keel.tools.python import PythonTools

    loop: list = []
    loop.append(loop)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    values = {"tuple keys": {("a", 1): 2}, "loop": loop, "deep": deep, "fine": {"a": (1, 2)}}

    def odd(kind):
        return values[kind]

    schema = {"type": "function", "function": {"name": "odd", "description": "", "parameters": {
        "type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}}}
    ep = ToolsEnv(PythonTools([odd], schemas=[schema])).start(TASK)
    for kind, reason in [("tuple keys", "(TypeError: keys must be str"), ("loop", "(ValueError: Circular reference detected)"),
                         ("deep", "(RecursionError")]:
        obs = ep.execute(ToolCall("odd", {"kind": kind}))
        assert (obs.ok, obs.error) == (False, "tool_exception")
        assert obs.text.startswith("Error: odd returned a value that JSON cannot encode " + reason) and "\n" not in obs.text
        assert obs.resolved == ("odd", json.dumps({"kind": kind}))  # it ran: a failed call, counted as one
    assert ep.execute(ToolCall("odd", {"kind": "fine"})).text == '{"a": [1, 2]}'
    ep.close()


def test_output_cap():
    ep = make_env(cap=10).start(TASK)
    assert ep.execute(ToolCall("big", {"n": 25})).text == "xxxxxxxxxx\n... (15 more characters not shown)"
    assert ep.execute(ToolCall("big", {"n": 10})).text == "x" * 10
    ep.close()


def test_state_is_per_episode_made_and_closed_on_the_episode_thread(user_tools):
    env = make_env()
    a, b = env.start(Task(id="a", question="q", answers=[])), env.start(Task(id="b", question="q", answers=[]))
    for _ in range(3):
        a.execute(ToolCall("add", {"a": 1, "b": 1}))
    b.execute(ToolCall("add", {"a": 1, "b": 1}))
    a.close(), b.close()
    states = {s.task_id: s for s in user_tools.STATES}
    assert (states["a"].calls, states["b"].calls, len(user_tools.STATES)) == (3, 1, 2)
    assert states["a"].closed and states["b"].closed
    # make_state, every call and close() ran on one thread per episode (sqlite3 needs that)
    assert len(states["a"].threads) == 1 and states["a"].threads != states["b"].threads


def test_timeout_answers_in_time_and_blocks_only_its_episode(user_tools):
    env = make_env(timeout=0.3)
    slow, other = env.start(TASK), env.start(TASK)
    t0 = time.time()
    obs = slow.execute(ToolCall("nap", {"seconds": 30}))
    assert time.time() - t0 < 5
    assert (obs.text, obs.error) == ("Error: TimeoutError: nap took longer than 0.3 s.", "timeout")
    again = slow.execute(ToolCall("add", {"a": 1, "b": 2}))
    assert again.text == "Error: TimeoutError: an earlier call (nap) of this episode is still running." and again.error == "timeout"
    assert other.execute(ToolCall("add", {"a": 1, "b": 2})).text == "3"
    t0 = time.time()
    slow.close(), other.close()
    assert time.time() - t0 < 2  # closing never waits for the hung call


def test_make_state_failure_is_every_call_s_answer(tmp_path):
    f = tmp_path / "broken_state.py"
    f.write_text("def make_state(task):\n    raise RuntimeError('no db')\n\n\ndef ping(state) -> str:\n    \"\"\"Ping.\"\"\"\n    return 'pong'\n")
    ep = ToolsEnv(build_python_backend([], str(f), "", "", "")).start(TASK)
    obs = ep.execute(ToolCall("ping", {}))
    assert (obs.text, obs.error) == ("Error: make_state failed (RuntimeError: no db)", "state_error")
    ep.close()


def test_tool_specs_and_their_errors(user_tools, tmp_path):
    other = tmp_path / "other_tools.py"
    other.write_text('def shout(text: str) -> str:\n    """Shout.\n\n    Args:\n        text: what to shout\n    """\n    return text.upper()\n')
    backend = build_python_backend([f"{TOOLS_FILE}:add", f"{other}:shout"], "", "", "", "")
    assert [t.name for t in backend.tools] == ["add", "shout"] and backend.make_state is user_tools.make_state
    from keel.tools.schema import ToolSchemaError

    with pytest.raises(ToolSchemaError, match="tool normalise: Cannot generate JSON schema for normalise because the docstring has no description for the argument 'text'"):
        build_python_backend(["keel.answers:normalise"], "", "", "", "")
    with pytest.raises(ToolLoadError, match="has no function 'nope'"):
        build_python_backend([f"{TOOLS_FILE}:nope"], "", "", "", "")
    with pytest.raises(ToolLoadError, match="must be module:function"):
        build_python_backend(["justaname"], "", "", "", "")
    with pytest.raises(ToolLoadError, match="exactly one of env.tools, env.tools_file, env.tools_schema"):
        build_python_backend([], "", "", "", "")


def test_failure_frequency_worked_example():
    from keel.diagnostics.episode_metrics import episode_record, failure_metrics

    def traj(oks):
        return Trajectory(task_id="t0", token_ids=[], sources=[], logprobs=[], answer="7",
                          steps=[Step(0, ToolCall("add", {}), Observation("x", ok=ok)) for ok in oks])

    # (tools, failed) = (2, 1), (3, 0), (0, 0) → 1 / 5
    records = [episode_record(traj(o), TASK) for o in ([True, False], [True] * 3, [])]
    assert failure_metrics(records) == {"tools/failure_frequency": pytest.approx(0.2)}
    assert failure_metrics([episode_record(traj([]), TASK)]) == {}


# --- hostile model output -------------------------------------------------------------------------
# The fragments Keel's BFCL parser is fuzzed with (tests/test_fc_parse.py), wrapped as Hermes
# calls of this module's tools with every kind of argument value.

from test_fc_parse import FRAGMENTS  # noqa: E402

NAMES = ["add", "greet", "tag", "fail", "big", "nope", ""]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True), st.integers(-50, 50).map(float), st.text(max_size=20),
                   st.lists(st.one_of(st.text(max_size=5), st.integers()), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                   st.sampled_from(FRAGMENTS))
ARGS = st.dictionaries(st.sampled_from(["a", "b", "name", "times", "loud", "words", "mode", "message", "n", "state", "x"]), VALUES, max_size=4)


def _wrap(kind, name, args, fragments):
    junk = "".join(fragments)
    if kind == 0:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    if kind == 1:
        return "<tool_call>" + junk + "</tool_call>"
    if kind == 2:
        return '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + junk + "}</tool_call>"
    if kind == 3:
        return "<tool_call>" + json.dumps({"name": name, "arguments": json.dumps(args)}) + "</tool_call>" + junk
    return junk


# well-formed calls whose arguments are then overwritten or extended by hostile ones (or not)
VALID = [("add", {"a": 1, "b": 2}), ("greet", {"name": "Ada"}), ("tag", {"words": ["a"], "mode": "upper"}), ("fail", {"message": "m"}), ("big", {"n": 3})]
near_valid = st.builds(lambda v, extra, keep: (v[0], {**v[1], **extra} if not keep else dict(v[1])), st.sampled_from(VALID), ARGS, st.booleans())
hostile = st.one_of(
    st.builds(_wrap, st.integers(0, 4), st.sampled_from(NAMES), ARGS, st.lists(st.sampled_from(FRAGMENTS), max_size=6)),
    st.builds(lambda kind, call, junk: _wrap(kind, call[0], call[1], junk), st.sampled_from([0, 3]), near_valid, st.lists(st.sampled_from(FRAGMENTS), max_size=2)),
)


def test_fuzz_no_exception_escapes_and_no_invalid_call_runs(user_tools):
    from keel.episode import process_turn

    env = make_env(timeout=5.0, cap=500)
    counts = {"ran": 0, "refused": 0}

    @settings(max_examples=3000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(hostile)
    def run(text):
        ep = env.start(TASK)
        try:
            before = len(user_tools.CALLS)
            outcome = process_turn(ep, text, 0)  # raises on nothing a model writes
            for s in outcome.steps:
                assert s.observation.error != "env_exception", (text, s.observation)
                assert "\n" not in s.observation.text or s.observation.ok
                counts["ran" if s.observation.error in (None, "tool_exception") else "refused"] += 1
            assert len(user_tools.CALLS) - before == sum(s.observation.error in (None, "tool_exception") for s in outcome.steps)
        finally:
            ep.close()

    run()
    assert user_tools.VIOLATIONS == []  # 0 schema-invalid calls reached a function
    assert counts["ran"] > 50 and counts["refused"] > 500, counts  # both sides were reached


# --- data.source: jsonl ---------------------------------------------------------------------------


def test_jsonl_tasks_fields_and_errors(tmp_path):
    from keel.tools.tasks import TaskFileError, load_jsonl_tasks

    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "2+5?", "answer": 7, "gold_calls": [[{"name": "add", "arguments": {"a": 2, "b": 5}}]], "level": 3, "tags": ["x"]}\n'
                 '\n{"id": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], "answer": ["a", "b"]}\n')
    a, b = load_jsonl_tasks(f)
    assert (a.id, a.question, a.answers, a.gold_turns) == ("t-1", "2+5?", ["7"], [[{"name": "add", "arguments": {"a": 2, "b": 5}}]])
    assert a.meta == {"fields": {"level": 3, "tags": ["x"]}, "has_gold": True}
    assert (b.id, b.question, b.answers, b.meta) == ("m", "hi", ["a", "b"], {"fields": {}, "has_gold": False, "system": "Be brief."})
    assert make_env().system_prompt(b) == "Be brief."
    for line, message in [
        ('{"answer": 1}', r"t.jsonl:1: a task needs prompt or messages"),
        ('{"prompt": "x", "gold_calls": [[{"name": "add"}]]}', r"t.jsonl:1: gold_calls need an answer"),
        ('{"prompt": "x", "answer": 1, "gold_calls": [["add"]]}', r"gold_calls\[0\] has a call that is not"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', r"multi-turn conversations are not supported"),
        ('[1]', r"a task must be a JSON object"),
    ]:
        f.write_text(line + "\n")
        with pytest.raises(TaskFileError, match=message):
            load_jsonl_tasks(f)


def _cfg(tmp_path, *overrides, n=25, gold=True):
    from keel.config import load_config

    f = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i}+1?", "answer": i + 1, **({"gold_calls": [[{"name": "add", "arguments": {"a": i, "b": 1}}]]} if gold else {})} for i in range(n)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, ["env.kind=tools", f"env.tools_file={TOOLS_FILE}", "data.source=jsonl", f"data.train={f}", *overrides])


def test_build_holds_out_a_tenth_and_refuses_signals_without_gold(tmp_path):
    from keel import tasks as task_builder
    from keel.tasks import DataError

    env, train, dev = task_builder.build(_cfg(tmp_path))
    assert (len(train), len(dev)) == (23, 2) and not {t.id for t in train} & {t.id for t in dev}  # 25 // 10 = 2 held out
    with pytest.raises(DataError, match=r"^sft.enabled trains on gold trajectories, but training task 'train-\d+' \(and 22 more\) has no gold_calls; add gold_calls to data.train or set sft.enabled=false$"):
        task_builder.build(_cfg(tmp_path, gold=False))
    with pytest.raises(DataError, match=r"^signals.ops.enabled trains on gold"):
        task_builder.build(_cfg(tmp_path, "sft.enabled=false", "signals.ops.enabled=true", gold=False))
    env, train, _ = task_builder.build(_cfg(tmp_path, "sft.enabled=false", gold=False))  # nothing needs gold: fine
    assert train[0].gold_turns == []


def test_gold_trajectory_replays_the_gold_calls(tiny, tmp_path, user_tools):
    from keel import tasks as task_builder
    from keel.sft import gold_trajectory

    _, tok = tiny
    env, train, _ = task_builder.build(_cfg(tmp_path))
    task = next(t for t in train if t.question == "4+1?")
    tr = gold_trajectory(tok, env, task)
    assert tr.turn_texts == ['<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 1}}\n</tool_call>', "<answer>5</answer>"]
    assert [s.observation.text for s in tr.steps] == ["5"] and tr.answer == "5" and tr.info["gold_ok"]
    assert user_tools.STATES[-1].closed


# --- rewards --------------------------------------------------------------------------------------


def _traj(answer, oks=()):
    return Trajectory(task_id="t", token_ids=[], sources=[], logprobs=[], answer=answer,
                      steps=[Step(0, ToolCall("f", {}), Observation("x", ok=ok)) for ok in oks])


def test_builtin_rewards_by_hand():
    from keel.rewards import REWARDS

    task = Task(id="t", question="q", answers=["New York", "NYC"])
    assert REWARDS["answer_em"](_traj("nyc"), task) == (1.0, {"em": 1.0, "f1": 0.0})  # EM takes any answer; F1 the primary only
    # F1 "new york city" vs "new york": common 2, precision 2/3, recall 1 → 0.8
    total, comps = REWARDS["answer_f1"](_traj("new york city"), task)
    assert total == pytest.approx(0.8) and comps == {"em": 0.0, "f1": pytest.approx(0.8)}
    assert REWARDS["calls_succeeded"](_traj("x", [True, True]), task) == (1.0, {"calls_succeeded": 1.0, "calls": 2.0, "failed_calls": 0.0})
    assert REWARDS["calls_succeeded"](_traj("x", [True, False, True]), task)[0] == 0.0
    assert REWARDS["calls_succeeded"](_traj("x", []), task)[0] == 0.0  # no call is not "every call succeeded"


def test_user_reward_from_a_file_sees_extra_fields(tmp_path):
    from keel.rewards import resolve_reward

    f = tmp_path / "my_reward.py"
    f.write_text("def level_weighted(traj, task):\n    w = task.meta['fields']['level']\n    ok = float(traj.answer == task.answers[0])\n"
                 "    return w * ok, {'ok': ok, 'level': w}\n\n\ndef broken(traj, task):\n    return 1.0\n")
    task = Task(id="t", question="q", answers=["7"], meta={"fields": {"level": 3}})
    assert resolve_reward(f"{f}:level_weighted")(_traj("7"), task) == (3.0, {"ok": 1.0, "level": 3.0})
    with pytest.raises(ValueError, match=r"reward .*:broken returned float '1.0'; expected \(total, \{component: number\}\)"):
        resolve_reward(f"{f}:broken")(_traj("7"), task)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward("nope")
