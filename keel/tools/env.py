"""The Env of user tools (`env.kind: tools | mcp`): one set of rules for every backend.

What a call goes through, in order (the first that fails is the tool's answer, one line):
1. it parsed (`keel.chat.parse_tool_calls`; else `Error: the call could not be parsed (bad_json).`);
2. it names a tool (`Error: unknown tool 'x'; the tools are a, b.`);
3. its arguments validate against the tool's schema (`Error: bad arguments for f: ...`);
4. the backend runs it within `call_timeout_s` (`Error: TimeoutError: f took longer than 10 s.`);
   an exception in the user's code is the answer `Error: ValueError: <message>`;
5. the result, if not a string, is JSON-encoded (a value JSON cannot encode, such as a dict with
   tuple keys, is the answer `Error: f returned a value that JSON cannot encode (TypeError: ...)`),
   and cut at `max_output_chars`.
Only step 4 runs user code, so no schema-invalid call reaches it (tests/test_tools.py fuzzes
this with the strings Keel's BFCL parser is fuzzed with). Every failed call has `ok=False`
and a machine-readable `error` (`bad_arguments`, `tool_exception`, `timeout`, ...), which
`tools/failure_frequency` and `tools/error/<kind>` count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from keel.errors import UserError
from keel.tools.schema import ArgumentChecker, one_line
from keel.types import Observation, Task, ToolCall

DEFAULT_INSTRUCTIONS = (
    "Answer the question using the tools. Several calls may go in one turn.\n"
    "To finish, reply <answer>ANSWER</answer> with no tool call."
)
MAX_ECHO = 60  # characters of a bad tool name quoted back
MAX_EXCEPTION_CHARS = 300  # of an exception message shown to the model


@dataclass
class Tool:
    name: str
    schema: dict[str, Any]  # OpenAI function format: what the model is shown
    checker: ArgumentChecker

    @classmethod
    def from_schema(cls, schema: dict[str, Any]) -> "Tool":
        fn = schema["function"]
        return cls(fn["name"], schema, ArgumentChecker(fn["name"], fn.get("parameters") or {"type": "object", "properties": {}}))


@dataclass
class CallResult:
    """What a backend returns for one checked call: the value, or the error text and kind."""

    value: Any = None
    error: str | None = None  # machine-readable kind: tool_exception, timeout, server_error, ...
    message: str = ""  # shown to the model after "Error: " when error is set


class Session(Protocol):
    """One episode's side of a backend (a Python state, a server connection)."""

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallResult: ...

    def close(self) -> None: ...


class Backend(Protocol):
    tools: list[Tool]

    def open(self, task: Task) -> Session: ...


def format_exception(exc: BaseException) -> str:
    """`ValueError: no such table: x` on one line (the model's view of a failing tool)."""
    text = str(exc)
    return one_line(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, MAX_EXCEPTION_CHARS)


def result_text(value: Any, limit: int) -> str:
    """A tool's return value as the text the model reads: strings as they are, anything else
    JSON (non-JSON values through `str`), cut after `limit` characters with a count of the rest.

    >>> result_text([("a", 1)], 100)
    '[["a", 1]]'
    >>> result_text("x" * 12, 5)
    'xxxxx\\n... (7 more characters not shown)'
    """
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if limit > 0 and len(text) > limit:
        text = text[:limit] + f"\n... ({len(text) - limit} more characters not shown)"
    return text


class ToolsEnv:
    """User tools as a Keel Env (keel.types.Env). `backend` lists and runs the tools."""

    def __init__(self, backend: Backend, instructions: str = "", call_timeout_s: float = 10.0, max_output_chars: int = 2000, name: str = "tools"):
        self.backend = backend
        self.by_name = {t.name: t for t in backend.tools}
        if len(self.by_name) != len(backend.tools):
            raise UserError("tools: two tools have the same name")
        self.instructions = instructions or DEFAULT_INSTRUCTIONS
        self.call_timeout_s = call_timeout_s
        self.max_output_chars = max_output_chars
        self.name = name

    def tools(self, task: Task) -> list[dict[str, Any]]:
        return [t.schema for t in self.backend.tools]

    def system_prompt(self, task: Task) -> str:
        return task.meta.get("system") or self.instructions

    def user_message(self, task: Task) -> str:
        return task.question

    def start(self, task: Task) -> "ToolsEpisode":
        return ToolsEpisode(self, task)

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


class ToolsEpisode:
    """One episode. The backend session (per-episode state) is opened at the first call that
    reaches the backend and closed by `close()`; an episode without valid calls costs nothing."""

    def __init__(self, env: ToolsEnv, task: Task):
        self.env = env
        self.task = task
        self.session: Session | None = None
        self.closed = False

    def execute(self, call: ToolCall) -> Observation:
        if self.closed:
            return _fail("episode_over", "the episode is over.")
        if call.error:
            return _fail(call.error, f"the call could not be parsed ({call.error}).")
        tool = self.env.by_name.get(call.name)
        if tool is None:
            return _fail("unknown_tool", f"unknown tool {_echo(call.name)}; the tools are {', '.join(self.env.by_name)}.")
        problem = tool.checker.problem(call.arguments)
        if problem is not None:
            return _fail("bad_arguments", f"bad arguments for {tool.name}: {problem}")
        if self.session is None:
            self.session = self.env.backend.open(self.task)
        try:
            result = self.session.call(tool.name, call.arguments, self.env.call_timeout_s)
        except Exception as exc:  # a backend bug must not kill a run either
            result = CallResult(error="env_exception", message=format_exception(exc))
        executed = (tool.name, _canonical(call.arguments))  # what makes two calls one (keel.rewards.call_key)
        if result.error is not None:
            return _fail(result.error, result.message, resolved=executed)
        try:  # tuple keys, a structure that holds itself, deep nesting: json.dumps raises even with default=str
            text = result_text(result.value, self.env.max_output_chars)
        except Exception as exc:
            return _fail("tool_exception", f"{tool.name} returned a value that JSON cannot encode ({format_exception(exc)})", resolved=executed)
        return Observation(text=text, ok=True, resolved=executed)

    def next_user_message(self) -> str | None:
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.session is not None:
            self.session.close()


def _fail(kind: str, message: str, resolved: tuple[str, ...] | None = None) -> Observation:
    return Observation(text=f"Error: {message}", ok=False, error=kind, resolved=resolved)


def _canonical(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _echo(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else type(value).__name__
    return one_line(text, MAX_ECHO)
