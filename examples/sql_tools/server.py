"""The example's tools served over MCP (stdio), written with the official SDK's low-level server.

    keel train examples/sql_tools/preset_mcp.yaml        (env.kind: mcp, env.mcp_command: [python, examples/sql_tools/server.py])

It lists the schemas of tools.json (the same schemas Keel derives from tools.py, so a model
sees the same prompt on both paths) and runs tools.py's functions on one read-only
connection for the whole process: the tools only read, so every episode sees the same
database, as with one copy per episode on the Python path. An exception inside a tool is
returned as an error result `<Type>: <message>`, which Keel shows as `Error: <Type>: <message>`
— the text the Python path shows for the same exception.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("sql_tools_tools", HERE / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)

SCHEMAS = json.loads((HERE / "tools.json").read_text())
STATE = tools.make_state(None)  # one in-memory copy of shop.db for the process (the tools only read)


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[
        types.Tool(name=s["function"]["name"], description=s["function"]["description"], input_schema=s["function"]["parameters"])
        for s in SCHEMAS])


async def call_tool(ctx, params) -> types.CallToolResult:
    fn = getattr(tools, params.name, None)
    if fn is None or params.name not in {s["function"]["name"] for s in SCHEMAS}:
        return types.CallToolResult(content=[types.TextContent(text=f"unknown tool {params.name}")], is_error=True)
    try:
        text = fn(**(params.arguments or {}), state=STATE)
    except Exception as e:
        message = str(e)
        return types.CallToolResult(content=[types.TextContent(text=f"{type(e).__name__}: {message}" if message else type(e).__name__)], is_error=True)
    return types.CallToolResult(content=[types.TextContent(text=text)])


server = Server("keel-sql-tools", on_list_tools=list_tools, on_call_tool=call_tool)


async def main() -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    asyncio.run(main())
