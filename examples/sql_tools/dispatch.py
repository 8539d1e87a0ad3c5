"""A dispatcher for tools.json (`env.tools_schema` + `env.dispatcher`): the OpenAI-format
schemas live in a file, the implementation here. Keel validates each call against tools.json
before it gets here, so `arguments` always match the schema."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("sql_tools_tools", Path(__file__).resolve().parent / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)

make_state = tools.make_state  # Keel finds make_state in the dispatcher's module


def dispatch(name: str, arguments: dict, state) -> str:
    return getattr(tools, name)(**arguments, state=state)
