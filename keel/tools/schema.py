"""Tool schemas and argument validation.

Schemas of Python functions come from type hints and Google-style docstrings through
`transformers.utils.get_json_schema` (Keel writes no schema generator). A parameter named
`state` is Keel's per-episode state (`keel.tools.python`): it is left out of the schema the
model sees, and it needs no type hint or docstring line.

Arguments are validated with `jsonschema` (Draft 2020-12) against the tool's `parameters`,
made strict at the top level in two ways the schema itself does not say:
- an argument the schema does not name is refused (`additionalProperties: false`, unless the
  schema sets `additionalProperties` itself): a model inventing `limit=` must hear so;
- `"nullable": true` (OpenAPI's spelling, which get_json_schema emits for `Optional[...]`) is
  read as "null is allowed too", since JSON Schema itself ignores the keyword.
And "integer" means a Python int: JSON Schema counts 2.0 (and 7.9e219) as an integer, but a
function annotated `int` must not receive a float (the fuzz test found exactly that).
"""

from __future__ import annotations

import copy
import inspect
import json
import typing
from pathlib import Path
from typing import Any, Callable

import jsonschema

from keel.errors import UserError, read_user_text

STATE_ARGUMENT = "state"
MAX_ERROR_CHARS = 200  # a validation message quotes the bad value; keep the model's view to one short line


class ToolSchemaError(UserError):
    """A tool whose schema cannot be built or is not a valid JSON schema (a user error; one line)."""


def function_schema(fn: Callable) -> dict[str, Any]:
    """The OpenAI-format schema of a Python function, `state` left out.

    get_json_schema reads the signature, the resolved type hints and the docstring; here it is
    given a stand-in with the same name, docstring and hints minus `state`, so `state` needs no
    type hint and the model never sees it. The `return` entry is dropped: the Hermes / Qwen
    tool listing has name, description and parameters only.
    """
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ToolSchemaError(f"tool {name}: cannot resolve its type hints ({type(e).__name__}: {e})") from None
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != STATE_ARGUMENT]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {name}: *args / **kwargs cannot be described by a JSON schema; name every argument")

    def stand_in(*args, **kwargs):  # never called: get_json_schema only reads it
        raise NotImplementedError

    stand_in.__name__ = name
    stand_in.__doc__ = fn.__doc__
    stand_in.__signature__ = sig.replace(parameters=params, return_annotation=sig.return_annotation)
    stand_in.__annotations__ = {k: v for k, v in hints.items() if k != STATE_ARGUMENT}
    try:
        schema = get_json_schema(stand_in)
    except Exception as e:
        raise ToolSchemaError(f"tool {name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    schema["function"].pop("return", None)
    return schema


def takes_state(fn: Callable) -> bool:
    return STATE_ARGUMENT in inspect.signature(fn).parameters


def validation_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema arguments are checked against: `parameters` with unknown top-level arguments
    refused and `nullable` honoured (see the module docstring).

    >>> validation_schema({"type": "object", "properties": {"n": {"type": "integer", "nullable": True}}})
    {'type': 'object', 'properties': {'n': {'type': ['integer', 'null']}}, 'additionalProperties': False}
    """
    out = _nullable(copy.deepcopy(parameters or {"type": "object", "properties": {}}))
    if out.get("type", "object") == "object":
        out.setdefault("additionalProperties", False)
    return out


def _nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.pop("nullable", False) is True:
        t = out.get("type")
        if isinstance(t, str):
            out["type"] = [t, "null"]
        elif isinstance(t, list) and "null" not in t:
            out["type"] = t + ["null"]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = out["enum"] + [None]
    return out


def _is_int(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_int))


class ArgumentChecker:
    """A compiled validator for one tool's arguments; `problem(arguments)` is None or one line."""

    def __init__(self, name: str, parameters: dict[str, Any]):
        self.name = name
        schema = validation_schema(parameters)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise ToolSchemaError(f"tool {name}: its parameters are not a valid JSON schema ({e.message[:120]})") from None
        self._validator = _Validator(schema)

    def problem(self, arguments: Any) -> str | None:
        if not isinstance(arguments, dict):
            return "the arguments must be a JSON object"
        try:
            error = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        except RecursionError:  # arguments nested beyond what the validator walks
            return "the arguments are nested too deeply"
        if error is None:
            return None
        where = ".".join(str(p) for p in error.absolute_path)
        return one_line((f"{where}: " if where else "") + error.message, MAX_ERROR_CHARS)


def one_line(text: str, limit: int) -> str:
    """`text` on one line, at most `limit` characters ("..." marks a cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_openai_tools(path: str | Path) -> list[dict[str, Any]]:
    """An OpenAI tools file: a JSON list of `{"type": "function", "function": {name,
    description, parameters}}` (a bare `{name, description, parameters}` is accepted too), or
    an object with such a list under "tools". Raises ToolSchemaError naming the entry."""
    p = Path(path)
    try:
        data = json.loads(read_user_text(p, "tools file"))
    except json.JSONDecodeError as e:
        raise ToolSchemaError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ToolSchemaError(f"{p}: not JSON (nested too deeply)") from None
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list) or not data:
        raise ToolSchemaError(f"{p}: expected a non-empty JSON list of tools")
    out = []
    for i, entry in enumerate(data):
        fn = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolSchemaError(f"{p}: tool {i} has no function name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolSchemaError(f"{p}: tool {fn['name']}: parameters must be a JSON object")
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}})
    names = [t["function"]["name"] for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolSchemaError(f"{p}: duplicate tool names {dup}")
    return out
