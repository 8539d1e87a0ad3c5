"""Tools served by an MCP server over stdio (`env.kind: mcp`), through the official `mcp` SDK.

Keel starts `env.mcp_command` once per run (a first word `python` is the interpreter running
Keel), lists the server's tools and their input schemas, and sends every call that passed
Keel's own checks (`keel.tools.env`) as `tools/call`; the answer's text content is the tool's
answer, and a result the server marks `isError` is the answer `Error: <its text>`.

Isolation: one server process per run, shared by every episode (and by the processes of a
data-parallel run, each of which starts its own). MCP has no notion of an episode, so Keel
resets nothing between episodes: a server whose tools only read (the example's SQL server
opens its database read-only) gives every episode the same world; a stateful server must key
its state itself, or be served through `env.kind: tools` with `make_state` instead.

A hung or dead server never ends a run: a call that gets no answer within `call_timeout_s` is
the answer `Error: TimeoutError: ...`, a call whose connection broke (the server crashed) is
`Error: the tool server failed ...`, and in both cases the server is killed (the SDK's shutdown:
stdin closed, then SIGTERM, then SIGKILL, each wait bounded) and started again before the next
call. If it cannot be started again, each later call answers that, and tries again.

The SDK is asyncio; Keel's loop is not. The connection lives on one background thread with its
own event loop, and each call is handed to it and waited for with a timeout.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from keel.tools.env import CallResult, Tool, format_exception
from keel.types import Task

START_TIMEOUT_S = 60.0  # to spawn the server, initialise the session and list the tools
SHUTDOWN_TIMEOUT_S = 10.0  # the SDK bounds its own shutdown at ~4.5 s (2 s grace, 2 s after SIGTERM, ...)


class MCPError(RuntimeError):
    """The server could not be started or listed (at the start of a run: a user error)."""


def _require_sdk():
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise MCPError("env.kind=mcp needs the mcp package: pip install 'keel[mcp]'") from None


class _Connection:
    """One running server: its process, the session, and the task that owns both."""

    def __init__(self, loop: asyncio.AbstractEventLoop, command: list[str]):
        self.loop = loop
        self.command = command
        self.session = None
        self.tools: list[Any] = []
        self.ready = asyncio.Event()
        self.stop = asyncio.Event()
        self.error: BaseException | None = None
        self.task = loop.create_task(self._run())

    async def _run(self) -> None:
        from mcp import ClientSession, StdioServerParameters, stdio_client

        params = StdioServerParameters(command=self.command[0], args=list(self.command[1:]), env=dict(os.environ))
        try:
            # the server's stderr goes to the process's real stderr (sys.stderr may be a capture without a file descriptor)
            async with stdio_client(params, errlog=sys.__stderr__ or sys.stderr) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    self.tools = list((await session.list_tools()).tools)
                    self.session = session
                    self.ready.set()
                    await self.stop.wait()
        except BaseException as e:  # a failed start, or the process died under the session
            self.error = e
        finally:
            self.session = None
            self.ready.set()


class MCPTools:
    """Backend: the tools of one MCP server process (restarted when it hangs or dies)."""

    def __init__(self, command: list[str], timeout_s: float = 10.0):
        _require_sdk()
        if not command:
            raise MCPError("env.mcp_command is empty")
        self.command = [sys.executable if command[0] == "python" else command[0], *command[1:]]
        self.timeout_s = timeout_s
        self.restarts = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="keel-mcp")
        self.thread.start()
        self.connection: _Connection | None = None
        self._closed = False
        atexit.register(self.close)
        try:
            listed = self._start()
        except MCPError:
            self.close()
            raise
        self.tools = [Tool.from_schema(_openai_schema(t)) for t in listed]

    # --- the connection, on the background loop ----------------------------------------------------
    def _submit(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _start(self) -> list[Any]:
        async def start():
            conn = _Connection(self.loop, self.command)
            await conn.ready.wait()
            return conn

        try:
            conn = self._submit(start(), START_TIMEOUT_S)
        except FutureTimeout:
            raise MCPError(f"env.mcp_command {' '.join(self.command)}: no answer within {START_TIMEOUT_S:g} s") from None
        if conn.session is None:
            raise MCPError(f"env.mcp_command {' '.join(self.command)}: the server did not start ({_reason(conn.error)})")
        self.connection = conn
        return conn.tools

    def _stop(self) -> None:
        conn, self.connection = self.connection, None
        if conn is None:
            return

        async def stop():
            conn.stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(conn.task), SHUTDOWN_TIMEOUT_S)
            except BaseException:
                conn.task.cancel()

        try:
            self._submit(stop(), SHUTDOWN_TIMEOUT_S + 5)
        except BaseException:
            pass

    def restart(self) -> str | None:
        """Kill the server and start it again; None, or why it did not come back."""
        self._stop()
        self.restarts += 1
        try:
            self._start()
            return None
        except MCPError as e:
            return str(e)

    # --- calls ---------------------------------------------------------------------------------------
    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallResult:
        if self.connection is None or self.connection.session is None:
            problem = self.restart()
            if problem is not None:
                return CallResult(error="server_error", message=f"the tool server is down ({problem})")
        session = self.connection.session
        future = asyncio.run_coroutine_threadsafe(session.call_tool(name, arguments), self.loop)
        try:
            result = future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            problem = self.restart()
            return CallResult(error="timeout", message=f"TimeoutError: {name} took longer than {timeout_s:g} s; the tool server was restarted"
                              + (f" but did not come back ({problem})." if problem else "."))
        except Exception as exc:  # the connection broke: the server died mid-call
            problem = self.restart()
            return CallResult(error="server_error", message=f"the tool server failed ({format_exception(exc)}); it was restarted"
                              + (f" but did not come back ({problem})." if problem else "."))
        text = "\n".join(getattr(c, "text", "") for c in result.content if getattr(c, "type", "") == "text")
        if not text and result.structured_content is not None:
            import json

            text = json.dumps(result.structured_content, ensure_ascii=False)
        if result.is_error:
            return CallResult(error="tool_exception", message=text or "the tool failed")
        return CallResult(value=text)

    def open(self, task: Task) -> "_EpisodeSession":
        return _EpisodeSession(self)  # one process for the run (module docstring)

    def close(self) -> None:
        """Stop the server (end of the run; also at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        self._stop()
        self.loop.call_soon_threadsafe(self.loop.stop)


class _EpisodeSession:
    """An episode's view of the shared server: its calls go to the server; closing it keeps the server."""

    def __init__(self, backend: MCPTools):
        self.backend = backend

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallResult:
        return self.backend.call(name, arguments, timeout_s)

    def close(self) -> None:
        pass


def _openai_schema(tool: Any) -> dict[str, Any]:
    """An MCP tool listing as the OpenAI function format the chat template lists.

    The SDK's Tool model moves `type` after `properties` / `required` in the input schema; it is
    put back first (get_json_schema's order: type, properties, required, the rest), so the same
    tools are listed in the same text, hence the same prompt tokens, on the Python and MCP paths.
    """
    raw = dict(tool.input_schema or {"type": "object", "properties": {}})
    schema = {k: raw[k] for k in ("type", "properties", "required") if k in raw}
    schema.update({k: v for k, v in raw.items() if k not in schema})
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "", "parameters": schema}}


def _reason(error: BaseException | None) -> str:
    if error is None:
        return "it exited"
    inner = getattr(error, "exceptions", None)  # an ExceptionGroup from the SDK's task group
    while inner:
        error = inner[0]
        inner = getattr(error, "exceptions", None)
    return format_exception(error)
