"""Bring your own tools: Python functions, an OpenAI tools file with a dispatcher, or an MCP server.

One environment (`keel.tools.env.ToolsEnv`) serves every source of tools; a *backend* only lists
the tools and runs a call that has already been checked. Everything a model writes is handled
in one place, the same for every backend: a call that did not parse, names no tool, or whose
arguments do not validate against the tool's JSON schema is answered with a one-line error and
never reaches the user's code; a call that does runs with a timeout and an output cap, and an
exception inside it becomes the tool's answer (`Error: ValueError: ...`).

    keel.tools.schema   schemas (transformers' get_json_schema), argument validation (jsonschema)
    keel.tools.python   Python functions and a dispatcher for an OpenAI tools file; per-episode state
    keel.tools.mcp      an MCP server over stdio (the `mcp` SDK), restarted when it hangs or dies
    keel.tools.env      the Env and Episode every backend shares
    keel.tools.tasks    `data.source: jsonl` tasks
"""
