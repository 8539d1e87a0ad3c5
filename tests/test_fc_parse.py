"""Literal-only call parsing: exact parses, structured errors, and a fuzz run that must execute
nothing. The fuzz run throws adversarial call strings at the parser *and* the BFCL executor."""

from __future__ import annotations

import ast
import builtins
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.fc.parse import CallParseError, canonical_call, check_arguments, parse_calls, parse_python_calls, render_calls
from keel.types import ToolCall


def test_python_list_parses_to_exact_values():
    calls = parse_calls("[cd(folder='a b'), mv(source=\"x.txt\", destination='y'), ls(a=True), f(n=-3, x=2.5, l=[1, (2, 3)], d={'k': None})]", "python")
    assert [(c.name, c.arguments) for c in calls] == [
        ("cd", {"folder": "a b"}),
        ("mv", {"source": "x.txt", "destination": "y"}),
        ("ls", {"a": True}),
        ("f", {"n": -3, "x": 2.5, "l": [1, (2, 3)], "d": {"k": None}}),
    ]
    assert all(c.error is None for c in calls)


def test_single_call_without_brackets_and_dotted_name():
    assert [(c.name, c.arguments) for c in parse_calls("math.factorial(number=5)", "python")] == [("math.factorial", {"number": 5})]


def test_positional_arguments_need_names():
    names = {"sort": ["file_name"]}.get
    assert parse_python_calls("sort('a.pdf')", names) == [("sort", {"file_name": "a.pdf"})]
    with pytest.raises(CallParseError) as e:
        parse_python_calls("sort('a.pdf')")
    assert e.value.code == "positional_args"
    with pytest.raises(CallParseError) as e:
        parse_python_calls("sort('a.pdf', 'b')", names)  # 2 positional for 1 parameter
    assert e.value.code == "positional_args"


@pytest.mark.parametrize(
    "text,code",
    [
        ("[__import__('os').system('echo hi')]", "bad_function_name"),
        ("[f(x=__import__('os'))]", "disallowed_node"),
        ("[f(x=(lambda: 1)())]", "disallowed_node"),
        ("[f(x=g(y=1))]", "disallowed_node"),
        ("[f(x=a.__class__)]", "disallowed_node"),
        ("[f(**{'a': 1})]", "star_args"),
        ("[f(*[1])]", "positional_args"),
        ("[f(x=1, x=2)]", "duplicate_argument"),  # ast.parse accepts it; only compile() rejects it
        ("[f(x=" + "9" * 25 + ")]", "literal_too_large"),
        ("[f(x=1e999)]", "literal_too_large"),
        ("[f(x='\\ud800')]", "bad_unicode"),
        ("[f(x={1, 2})]", "disallowed_node"),
        ("[f(x=b'raw')]", "disallowed_node"),
        ("[f(x=1j)]", "disallowed_node"),
        ("[f(x=" + "[" * 40 + "]" * 40 + ")]", "too_deep"),
        ("[f(x=1), 2]", "not_a_call"),
        ("[f(x=1)", "bad_syntax"),
        ("[obj[0](x=1)]", "bad_function_name"),
        ("[f(x=-'a')]", "disallowed_node"),
    ],
)
def test_non_literal_calls_are_structured_errors(text, code):
    calls = parse_calls(text, "python")
    assert len(calls) == 1 and calls[0].error == code, (text, calls)


def test_prose_is_not_a_call_but_tagged_prose_is_an_error():
    assert parse_calls("The file has been moved.", "python") == []
    assert parse_calls("no calls here", "python_tagged") == []
    assert parse_calls("<TOOLCALL>hello</TOOLCALL>", "python_tagged")[0].error == "not_a_call"  # a bare name
    assert parse_calls("<TOOLCALL>[ls()]", "python_tagged")[0].error == "unclosed_tag"
    assert parse_calls("x", "yaml")[0].error == "unknown_call_format"


def test_canonical_call_round_trips_through_literal_eval():
    args = {"a": 1, "b": "it's", "c": [1.5, None, True], "d": {"k": (1, 2)}}
    s = canonical_call("f", args)
    assert s == "f(a=1, b=\"it's\", c=[1.5, None, True], d={'k': (1, 2)})"
    tree = ast.parse(s, mode="eval").body
    assert {kw.arg: ast.literal_eval(kw.value) for kw in tree.keywords} == args
    for bad_name in ("__import__", "os.system;x", "a b", "f.__class__"):
        with pytest.raises(CallParseError):
            canonical_call(bad_name, {})
    with pytest.raises(CallParseError):
        canonical_call("f", {"not an identifier": 1})
    with pytest.raises(CallParseError):
        check_arguments({"x": float("nan")})


@pytest.mark.parametrize("fmt", ["json", "python", "python_tagged"])
def test_render_then_parse_is_identity(fmt):
    calls = [{"name": "mv", "arguments": {"source": "a", "destination": "b"}}, {"name": "ls", "arguments": {}}]
    parsed = parse_calls(render_calls(calls, fmt), fmt)
    assert [{"name": c.name, "arguments": c.arguments} for c in parsed] == calls


def test_hermes_calls_longer_than_chat_limit_are_parsed():
    # BFCL long_context gold calls reach 6743 characters as JSON; keel.chat stops at 4096.
    content = "x" * 6000
    text = "<tool_call>\n" + json.dumps({"name": "post_tweet", "arguments": {"content": content}}) + "\n</tool_call>"
    (call,) = parse_calls(text, "json")
    assert call.error is None and call.arguments["content"] == content
    (too_long,) = parse_calls("<tool_call>" + json.dumps({"name": "f", "arguments": {"c": "y" * 20000}}) + "</tool_call>", "json")
    assert too_long.error == "too_long"


# ---------------------------------------------------------------------------------------------
# Fuzz: nothing a model writes is executed, nothing raises, every failure is structured.

SENTINEL_HITS: list[str] = []
SUSPICIOUS = {"keel_fc_sentinel", "__import__", "eval", "exec", "open", "system", "__class__", "__subclasses__", "getattr", "compile"}


def _audit(event, args):
    # eval()/exec() of any code object fires "exec"; a code object naming a suspicious global
    # means model text reached an evaluator.
    if event == "exec" and args and hasattr(args[0], "co_names"):
        names = set(args[0].co_names)
        if names & SUSPICIOUS:
            SENTINEL_HITS.append(",".join(sorted(names & SUSPICIOUS)))


sys.addaudithook(_audit)


def _sentinel(*a, **k):
    SENTINEL_HITS.append("called")
    return "sentinel"


builtins.keel_fc_sentinel = _sentinel

FRAGMENTS = [
    "[", "]", "(", ")", ",", "=", "'", '"', "\\", "{", "}", ":", "*", "**", ".", " ", "\n",
    "cd", "ls", "mv", "add", "power", "multiply", "square_root", "pwd", "echo", "keel_fc_sentinel",
    "__import__('os')", "__import__", "os.system('touch /tmp/keel_pwned')", "lambda: keel_fc_sentinel()",
    "(lambda x: x)(1)", "keel_fc_sentinel()", "().__class__.__bases__[0].__subclasses__()", "eval('1')",
    "exec('x=1')", "open('/etc/passwd')", "getattr(a, 'b')", "a=1", "b='x'", "folder='..'", "base=10",
    "exponent=" + "9" * 18, "exponent=99999", "a='x'", "b=" + "9" * 18, "precision=" + "9" * 12,
    "1e999", "-1", "--1", "1j", "None", "True", "[[[[[[", "]]]]]]", "{'a': [1, {'b': (2,)}]}",
    "\ud800", "\x00", "\u202e", "é", "<tool_call>", "</tool_call>", "<TOOLCALL>", "</TOOLCALL>",
    '{"name": "cd", "arguments": {"folder": "..")}', '{"name": "__import__", "arguments": {}}',
    "f(*args)", "f(**kw)", "x" * 50, "'" + "A" * 300 + "'", "\"\"\"", "#", "@decorator", "async", "await",
    "yield", "import os", ";", "if 1 else", "f'{keel_fc_sentinel()}'",
]
WRAPS = [
    lambda s: s,
    lambda s: "[" + s + "]",
    lambda s: "<TOOLCALL>[" + s + "]</TOOLCALL>",
    lambda s: "<tool_call>" + s + "</tool_call>",
    lambda s: '<tool_call>{"name": "echo", "arguments": {"content": ' + json.dumps(s) + "}}</tool_call>",
    lambda s: "[cd(folder=" + s + ")]",
    lambda s: "[" + s + "(a=1, b=2)]",
]

call_text = st.builds(lambda parts, w: WRAPS[w]("".join(parts)), st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=8), st.integers(0, len(WRAPS) - 1))
KNOWN_ERRORS = {
    "bad_syntax", "not_a_call", "bad_function_name", "positional_args", "star_args", "duplicate_argument",
    "disallowed_node", "literal_too_large", "bad_unicode", "too_deep", "too_many_nodes", "too_long", "bad_dict_key",
    "bad_json", "bad_call", "unclosed_tag", "unknown_tool", "bad_arguments", "argument_out_of_range", "tool_error",
    "step_limit", "episode_over",
}


@pytest.fixture(scope="module")
def fuzz_episodes():
    from keel.fc.bfcl import load_bfcl_multi_turn
    from keel.fc.learnable import generate_tasks

    base = load_bfcl_multi_turn("base", ids=["multi_turn_base_0"])[0]  # GorillaFileSystem + TwitterAPI
    math = generate_tasks(1, seed=0, kinds=("math",))[0]
    return base, math


def _fuzz_one(text: str, tasks, counter: dict[str, int]) -> None:
    from keel.fc.bfcl import BfclEpisode

    for task in tasks:
        for fmt in ("python", "json", "python_tagged"):
            episode = BfclEpisode(task, fmt, step_limit=10**9)
            try:
                calls = episode.parse(text)
                for call in calls:
                    assert isinstance(call, ToolCall)
                    obs = episode.execute(call)
                    if not obs.ok:
                        assert obs.error in KNOWN_ERRORS, (text, obs)
                        counter[obs.error] = counter.get(obs.error, 0) + 1
                    else:
                        counter["ran"] = counter.get("ran", 0) + 1
            finally:
                episode.closed = True  # skip the checker replay: this run is about the executor
                from keel.fc.bfcl import purge_instances

                purge_instances(episode.model_name)


def _run_fuzz(n: int, fuzz_episodes) -> dict[str, int]:
    counter: dict[str, int] = {}
    SENTINEL_HITS.clear()

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(call_text)
    def run(text):
        _fuzz_one(text, fuzz_episodes, counter)

    run()
    assert SENTINEL_HITS == [], SENTINEL_HITS
    return counter


def test_fuzz_5k_executes_nothing(fuzz_episodes):
    counter = _run_fuzz(5000, fuzz_episodes)
    # The run must reach both sides: some calls ran on the simulators, some were refused.
    assert counter.get("ran", 0) > 0 and counter.get("disallowed_node", 0) + counter.get("bad_syntax", 0) > 0, counter
    from keel.fc.bfcl import cached_instance_count

    assert cached_instance_count() == 0


@pytest.mark.slow
def test_fuzz_100k_executes_nothing(fuzz_episodes):
    counter = _run_fuzz(100_000, fuzz_episodes)
    print("fuzz outcomes over 100k strings x 2 entries x 3 formats:", sorted(counter.items()))
    assert counter.get("ran", 0) > 0


def test_sentinel_would_fire_if_text_were_evaluated():
    # The detector itself works: evaluating model text the way bfcl-eval does trips it.
    SENTINEL_HITS.clear()
    eval("keel_fc_sentinel()")  # noqa: S307 - deliberate, to prove the sentinel is live
    assert "called" in SENTINEL_HITS and "keel_fc_sentinel" in SENTINEL_HITS
    SENTINEL_HITS.clear()
