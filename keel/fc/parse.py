"""Literal-only parsing of function calls, and their canonical re-serialisation.

BFCL and ACEBench ask models for Python-call lists `[f(a=1, b='x'), g()]` and then run them
with `eval()`. Keel never does that with model text: a call list is read with `ast.parse`
(which builds a tree and runs nothing), every argument must be a plain literal (str, int,
float, bool, None, and lists / tuples / dicts of them, a unary minus on a number), and only
`canonical_call(name, arguments)` — rebuilt from those values with `repr` — is ever handed to
an evaluator. Departure from BFCL's own decoder: positional arguments are accepted only when
the caller can name them (the simulator's signature); anything else is a structured error.

Three call formats (the format-OOD axis of paper A):
    "json"          Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (training format)
    "python"        BFCL's prompting format, a bare list `[f(a=1), g(b='x')]`
    "python_tagged" the same list inside BFCL's `<TOOLCALL>...</TOOLCALL>` tag
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from typing import Any, Callable

from keel.chat import parse_tool_calls, render_assistant_calls
from keel.types import ToolCall

CALL_FORMATS = ("json", "python", "python_tagged")

MAX_TEXT_CHARS = 16384  # a whole call list longer than this is rejected before ast.parse
MAX_DEPTH = 32  # literal nesting depth (a BFCL argument nests at most 4 deep)
MAX_NODES = 4096  # literal nodes per call list
MAX_INT_DIGITS = 19  # |int| < 10**19 covers int64; bigger literals are "literal_too_large"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_TAG_RE = re.compile(r"<TOOLCALL>(.*?)</TOOLCALL>", re.DOTALL)
_FENCE_RE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")


class CallParseError(ValueError):
    """A call list that is not literal-only. `code` is the machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


PositionalNames = Callable[[str], "list[str] | None"]


def parse_calls(text: str, call_format: str = "json", positional_names: PositionalNames | None = None) -> list[ToolCall]:
    """Every call of one assistant turn in the given format. Never raises on model text.

    An empty list means "no call" (the turn is an answer). A text that tries to be a call but
    is not literal-only gives one ToolCall with `error` set, so the model sees why.

    >>> [(c.name, c.arguments) for c in parse_calls("[cd(folder='a'), ls()]", "python")]
    [('cd', {'folder': 'a'}), ('ls', {})]
    """
    if not isinstance(text, str):
        return [ToolCall(name="", arguments={}, raw="", error="bad_text")]
    if call_format == "json":
        return parse_hermes(text)
    if call_format == "python_tagged":
        blocks = _TAG_RE.findall(text)
        if not blocks:
            if "<TOOLCALL>" in text:
                return [ToolCall(name="", arguments={}, raw=text[:256], error="unclosed_tag")]
            return []
        calls: list[ToolCall] = []
        for block in blocks:
            calls.extend(_parse_python_block(block, positional_names, force=True))
        return calls
    if call_format == "python":
        return _parse_python_block(text, positional_names, force=False)
    return [ToolCall(name="", arguments={}, raw="", error="unknown_call_format")]


_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """`keel.chat.parse_tool_calls` with a per-call limit of MAX_TEXT_CHARS instead of
    keel.chat.MAX_CALL_CHARS (4096): BFCL long_context gold calls reach 6743 characters as
    JSON (a post_tweet quoting a long file). Blocks within 4096 characters are parsed by
    keel.chat itself; longer ones by the same rules here."""
    calls = parse_tool_calls(text)
    if not any(c.error == "too_long" for c in calls):
        return calls
    bodies = [m.group(1) for m in _HERMES_RE.finditer(text)]
    out = []
    for i, c in enumerate(calls):
        if c.error == "too_long" and i < len(bodies) and len(bodies[i].strip()) <= MAX_TEXT_CHARS:
            out.append(_parse_json_call(bodies[i].strip()))
        else:
            out.append(c)
    return out


def _parse_json_call(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return ToolCall(name="", arguments={}, raw=_clip(raw), error="bad_json")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(name="", arguments={}, raw=_clip(raw), error="bad_call")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError, ValueError):
            return ToolCall(name=obj["name"], arguments={}, raw=_clip(raw), error="bad_json")
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], arguments={}, raw=_clip(raw), error="bad_call")
    return ToolCall(name=obj["name"], arguments=args, raw=_clip(raw))


def _parse_python_block(text: str, positional_names: PositionalNames | None, force: bool) -> list[ToolCall]:
    body = _FENCE_RE.sub("", text.strip()).strip()
    if not body:
        return []
    # BFCL's prompting loop ends a turn when the text does not decode as a call list; Keel does
    # the same for plain prose, but text shaped like a call list gets an error the model can see.
    looks_like_calls = (body.startswith("[") and "(" in body) or bool(re.match(r"^[A-Za-z_][\w.]*\s*\(", body))
    if not looks_like_calls and not force:
        return []
    try:
        return [ToolCall(name=n, arguments=a, raw=_clip(body)) for n, a in parse_python_calls(body, positional_names)]
    except CallParseError as exc:
        return [ToolCall(name="", arguments={}, raw=_clip(body), error=exc.code)]


def _clip(s: str, n: int = 512) -> str:
    return s if len(s) <= n else s[:n]


def parse_python_calls(text: str, positional_names: PositionalNames | None = None) -> list[tuple[str, dict[str, Any]]]:
    """`[f(a=1), g(b='x')]` or `f(a=1)` as [(name, arguments)]; raises CallParseError (only).

    `positional_names(name)` gives the parameter names a positional argument maps to, in
    order; without it a positional argument is an error (`positional_args`).
    """
    if len(text) > MAX_TEXT_CHARS:
        raise CallParseError("too_long", f"call text has {len(text)} characters, limit {MAX_TEXT_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CallParseError("bad_unicode", "call text is not valid unicode (lone surrogate)") from None
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and similar are noise here
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        raise CallParseError("bad_syntax", f"not a Python call list: {type(exc).__name__}") from None
    body = tree.body
    items = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    budget = [MAX_NODES]
    out = []
    for node in items:
        if not isinstance(node, ast.Call):
            raise CallParseError("not_a_call", f"list element is {type(node).__name__}, expected a function call")
        name = _dotted_name(node.func)
        arguments: dict[str, Any] = {}
        if node.args:
            names = positional_names(name) if positional_names else None
            if names is None or len(node.args) > len(names):
                raise CallParseError("positional_args", f"{name}: positional arguments need keyword names")
            for pname, arg in zip(names, node.args):
                if isinstance(arg, ast.Starred):
                    raise CallParseError("star_args", f"{name}: *args is not allowed")
                arguments[pname] = _literal(arg, 0, budget)
        for kw in node.keywords:
            if kw.arg is None:
                raise CallParseError("star_args", f"{name}: **kwargs is not allowed")
            if kw.arg in arguments:
                raise CallParseError("duplicate_argument", f"{name}: argument {kw.arg!r} given twice")
            arguments[kw.arg] = _literal(kw.value, 0, budget)
        out.append((name, arguments))
    return out


def _dotted_name(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise CallParseError("bad_function_name", f"function must be a plain name, got {type(node).__name__}")
    parts.append(node.id)
    name = ".".join(reversed(parts))
    if any(p.startswith("__") for p in parts):
        raise CallParseError("bad_function_name", f"dunder name {name!r} is not allowed")
    return name


def _literal(node: ast.AST, depth: int, budget: list[int]) -> Any:
    """The value of a literal-only expression tree; anything else raises CallParseError."""
    budget[0] -= 1
    if budget[0] < 0:
        raise CallParseError("too_many_nodes", f"more than {MAX_NODES} literal nodes")
    if depth > MAX_DEPTH:
        raise CallParseError("too_deep", f"literal nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant):
        return _check_scalar(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        v = node.operand.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CallParseError("disallowed_node", "unary sign on a non-number")
        return _check_scalar(-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.List):
        return [_literal(e, depth + 1, budget) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e, depth + 1, budget) for e in node.elts)
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise CallParseError("star_args", "**mapping inside a dict is not allowed")
            key = _literal(k, depth + 1, budget)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise CallParseError("bad_dict_key", f"dict key of type {type(key).__name__}")
            out[key] = _literal(v, depth + 1, budget)
        return out
    raise CallParseError("disallowed_node", f"{type(node).__name__} is not a literal")


def _check_scalar(v: Any) -> Any:
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        if abs(v) >= 10**MAX_INT_DIGITS:
            raise CallParseError("literal_too_large", f"integer literal with more than {MAX_INT_DIGITS} digits")
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise CallParseError("literal_too_large", "non-finite float")
        return v
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise CallParseError("bad_unicode", "string literal with a lone surrogate") from None
        return v
    raise CallParseError("disallowed_node", f"{type(v).__name__} literal is not allowed")


def check_arguments(arguments: Any) -> dict[str, Any]:
    """Validate arguments that came from JSON (the Hermes format) by the same literal rules.

    Raises CallParseError. JSON can only hold literals, but it can hold huge numbers, deep
    nesting, non-identifier keys and lone surrogates, which must not reach an evaluator.
    """
    if not isinstance(arguments, dict):
        raise CallParseError("bad_call", "arguments must be an object")
    budget = [MAX_NODES]
    for k in arguments:
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("__"):
            raise CallParseError("bad_argument_name", f"argument name {str(k)[:40]!r} is not an identifier")
    return {k: _check_value(v, 0, budget) for k, v in arguments.items()}


def _check_value(v: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise CallParseError("too_many_nodes", f"more than {MAX_NODES} literal nodes")
    if depth > MAX_DEPTH:
        raise CallParseError("too_deep", f"literal nested deeper than {MAX_DEPTH}")
    if isinstance(v, list):
        return [_check_value(e, depth + 1, budget) for e in v]
    if isinstance(v, tuple):
        return tuple(_check_value(e, depth + 1, budget) for e in v)
    if isinstance(v, dict):
        out = {}
        for k, e in v.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CallParseError("bad_dict_key", f"dict key of type {type(k).__name__}")
            _check_scalar(k)
            out[k] = _check_value(e, depth + 1, budget)
        return out
    return _check_scalar(v)


def literal_repr(v: Any) -> str:
    """Python source for a checked literal value; `ast.literal_eval(literal_repr(v)) == v`."""
    if isinstance(v, (list, tuple, dict)) or v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    raise CallParseError("disallowed_node", f"{type(v).__name__} cannot be serialised")


def canonical_call(name: str, arguments: dict[str, Any]) -> str:
    """`name(a=1, b='x')` from a name and checked arguments; the only text given to eval().

    The name must be a plain (dotted) identifier and every argument passes `check_arguments`;
    otherwise CallParseError. Example: canonical_call("cd", {"folder": "a"}) == "cd(folder='a')".
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or "__" in name:
        raise CallParseError("bad_function_name", f"function name {str(name)[:40]!r} is not a plain identifier")
    args = check_arguments(arguments)
    return f"{name}(" + ", ".join(f"{k}={literal_repr(v)}" for k, v in args.items()) + ")"


def render_calls(calls: list[dict[str, Any]], call_format: str = "json") -> str:
    """Assistant text that makes `calls` ({"name", "arguments"} dicts) in the given format."""
    if call_format == "json":
        return render_assistant_calls(calls)
    listing = "[" + ", ".join(canonical_call(c["name"], c["arguments"]) for c in calls) + "]"
    if call_format == "python":
        return listing
    if call_format == "python_tagged":
        return f"<TOOLCALL>{listing}</TOOLCALL>"
    raise ValueError(f"unknown call_format {call_format!r}; expected one of {CALL_FORMATS}")


def json_safe(v: Any) -> Any:
    """Tuples as lists, for writing results to JSON files."""
    return json.loads(json.dumps(v, default=str))


class AnswerOnceEpisode:
    """A single-answer episode (BFCL single-turn, ACEBench): the first assistant message is the
    answer; its calls are recorded, not run (these benchmarks judge by AST), and `judge` scores
    them at close(), filling `info["checker_valid"]`."""

    def __init__(self, task, call_format: str):
        self.task = task
        self.call_format = call_format
        self.text: str | None = None
        self.calls: list = []
        self.info: dict = {}

    def parse(self, text: str) -> list:
        calls = parse_calls(text, self.call_format)
        if self.text is None:
            self.text, self.calls = text, list(calls)
        return calls

    def execute(self, call):
        from keel.types import Observation

        return Observation(text="Function call recorded.", ok=call.error is None, error=call.error)

    def next_user_message(self) -> str | None:
        return None

    def judge(self) -> tuple[bool, str | None]:
        raise NotImplementedError

    def close(self) -> None:
        valid, error_type = self.judge()
        self.info = {"checker_valid": valid, "checker_error_type": error_type}
