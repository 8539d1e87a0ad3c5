"""Python tools: functions (`env.tools`, `env.tools_file`) or an OpenAI tools file with a
dispatcher (`env.tools_schema` + `env.dispatcher`), with per-episode state.

Per-episode state: a tool function may take an argument named `state` (hidden from its
schema). Keel makes it per episode with `make_state(task)` from the tools' module (or
`env.make_state`), passes it to every call of that episode, and after the episode calls its
`close()` if it has one; without `make_state`, `state` is None. So a database connection or a
sandbox is never shared between two rollouts.

Each episode's calls, `make_state` and `close()` run on one thread of their own (a
`sqlite3` connection may be used only on the thread that made it), and the episode waits for
each call at most `call_timeout_s`. Python cannot kill a thread: a call that times out keeps
running in the background (a daemon thread, so it never holds up the process's exit), its
episode answers every later call with a TimeoutError at once, and its state is closed when (if)
the call returns. For tools that must be killable, serve them over MCP (`env.kind: mcp`):
there a hung server is killed and restarted.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import queue
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from keel.errors import UserError
from keel.tools.env import CallResult, Tool, format_exception
from keel.tools.schema import STATE_ARGUMENT, ToolSchemaError, function_schema, load_openai_tools, takes_state
from keel.types import Task

MAKE_STATE = "make_state"


class ToolLoadError(UserError):
    """A tool spec that cannot be loaded (module missing, no such function); one line."""


def load_module(path_or_name: str) -> ModuleType:
    """A module from a dotted name, or from a `.py` file path (loaded under a name derived from
    its resolved path, so two files called tools.py do not clash; loaded once per process)."""
    if path_or_name.endswith(".py"):
        p = Path(path_or_name).resolve()
        if not p.is_file():
            raise ToolLoadError(f"tools file not found: {path_or_name}")
        name = "keel_user_" + "_".join(p.with_suffix("").parts[1:]).replace("-", "_").replace(".", "_")
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, p)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ToolLoadError(f"{path_or_name}: importing it failed ({format_exception(e)})") from None
        return module
    try:
        return importlib.import_module(path_or_name)
    except ImportError as e:
        raise ToolLoadError(f"cannot import module {path_or_name!r} ({e})") from None


def load_callable(spec: str, what: str = "tool") -> Callable:
    """`module:function` or `path/to/file.py:function` → the function."""
    if ":" not in spec:
        raise ToolLoadError(f"{what} {spec!r} must be module:function or path/to/file.py:function")
    module_name, _, attr = spec.rpartition(":")
    fn = getattr(load_module(module_name), attr, None)
    if not callable(fn):
        raise ToolLoadError(f"{what} {spec!r}: {module_name} has no function {attr!r}")
    return fn


def public_functions(module: ModuleType) -> list[Callable]:
    """Every public function defined in `module` (not imported into it), in source order;
    `make_state` is not a tool."""
    fns = [f for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_") and n != MAKE_STATE
           and f.__module__ == module.__name__]
    return sorted(fns, key=lambda f: f.__code__.co_firstlineno)


class _Worker:
    """One episode's thread: runs jobs in order; `submit` returns a waitable slot."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="keel-tools-episode")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, done, box = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # SystemExit from a tool must not end anything either
                box.append((False, exc))
            done.set()

    def submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, list]:
        done, box = threading.Event(), []
        self.jobs.put((fn, done, box))
        return done, box

    def stop(self) -> None:
        self.jobs.put(None)


class PythonSession:
    """Per-episode state and the thread the episode's calls run on."""

    def __init__(self, functions: dict[str, Callable], make_state: Callable | None, task: Task, wants_state: set[str]):
        self.functions = functions
        self.make_state = make_state
        self.task = task
        self.wants_state = wants_state
        self.worker = _Worker()
        self.state: Any = None
        self.state_error: BaseException | None = None
        self.hung: str | None = None  # the tool whose call timed out

    def _state(self) -> Any:  # on the worker thread, before the episode's first call
        if self.make_state is not None and self.state is None and self.state_error is None:
            try:
                self.state = self.make_state(self.task)
            except BaseException as e:
                self.state_error = e
        if self.state_error is not None:
            raise _StateError(format_exception(self.state_error))
        return self.state

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallResult:
        if self.hung is not None:
            return CallResult(error="timeout", message=f"TimeoutError: an earlier call ({self.hung}) of this episode is still running.")
        fn = self.functions[name]
        kwargs = dict(arguments)

        def job():
            state = self._state()
            if name in self.wants_state:
                kwargs[STATE_ARGUMENT] = state
            return fn(**kwargs)

        done, box = self.worker.submit(job)
        if not done.wait(timeout_s if timeout_s > 0 else None):
            self.hung = name
            return CallResult(error="timeout", message=f"TimeoutError: {name} took longer than {timeout_s:g} s.")
        ok, value = box[0]
        if ok:
            return CallResult(value=value)
        if isinstance(value, _StateError):
            return CallResult(error="state_error", message=f"make_state failed ({value})")
        return CallResult(error="tool_exception", message=format_exception(value))

    def close(self) -> None:
        def job():
            close = getattr(self.state, "close", None)
            if callable(close):
                close()

        self.worker.submit(job)  # after a hung call, runs when (if) that call returns
        self.worker.stop()
        if self.hung is None:
            self.worker.thread.join(timeout=5.0)


class _StateError(Exception):
    pass


class PythonTools:
    """Backend for Python functions. `functions` are called with the validated arguments."""

    def __init__(self, functions: list[Callable], make_state: Callable | None = None, schemas: list[dict[str, Any]] | None = None):
        self.functions = {f.__name__: f for f in functions}
        if len(self.functions) != len(functions):
            names = [f.__name__ for f in functions]
            raise ToolSchemaError(f"tools: duplicate tool names {sorted({n for n in names if names.count(n) > 1})}")
        if not functions:
            raise ToolSchemaError("tools: no tool functions were given")
        self.make_state = make_state
        schemas = schemas if schemas is not None else [function_schema(f) for f in functions]
        self.tools = [Tool.from_schema(s) for s in schemas]
        self.wants_state = {f.__name__ for f in functions if takes_state(f)}

    def open(self, task: Task) -> PythonSession:
        return PythonSession(self.functions, self.make_state, task, self.wants_state)


class DispatchSession(PythonSession):
    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> CallResult:
        return super().call("__dispatch__", {"name": name, "arguments": arguments}, timeout_s)


class DispatchTools:
    """Backend for an OpenAI tools file: every checked call goes to one Python callable
    `dispatcher(name, arguments)` (or `dispatcher(name, arguments, state)`)."""

    def __init__(self, schemas: list[dict[str, Any]], dispatcher: Callable, make_state: Callable | None = None):
        self.tools = [Tool.from_schema(s) for s in schemas]
        self.dispatcher = dispatcher
        self.make_state = make_state
        self.with_state = takes_state(dispatcher)

    def open(self, task: Task) -> DispatchSession:
        dispatcher, with_state = self.dispatcher, self.with_state

        def dispatch(name, arguments, state=None):
            return dispatcher(name, arguments, state=state) if with_state else dispatcher(name, arguments)

        return DispatchSession({"__dispatch__": dispatch}, self.make_state, task, {"__dispatch__"})


def build_python_backend(tools: list[str], tools_file: str, tools_schema: str, dispatcher: str, make_state: str):
    """The backend a config asks for (exactly one of tools / tools_file / tools_schema)."""
    given = [k for k, v in (("env.tools", tools), ("env.tools_file", tools_file), ("env.tools_schema", tools_schema)) if v]
    if len(given) != 1:
        raise ToolLoadError("env.kind=tools needs exactly one of env.tools, env.tools_file, env.tools_schema" + (f" (got {', '.join(given)})" if given else ""))
    state_fn = load_callable(make_state, "env.make_state") if make_state else None
    if tools_schema:
        if not dispatcher:
            raise ToolLoadError("env.tools_schema needs env.dispatcher (module:function called as fn(name, arguments[, state]))")
        if not Path(tools_schema).is_file():
            raise ToolLoadError(f"env.tools_schema: file not found: {tools_schema}")
        fn = load_callable(dispatcher, "env.dispatcher")
        if state_fn is None:
            state_fn = getattr(sys.modules.get(fn.__module__), MAKE_STATE, None)
        return DispatchTools(load_openai_tools(tools_schema), fn, state_fn)
    if tools_file:
        module = load_module(tools_file if tools_file.endswith(".py") else tools_file + ".py")
        functions = public_functions(module)
        if not functions:
            raise ToolLoadError(f"env.tools_file {tools_file}: no public functions")
        modules = [module]
    else:
        functions = [load_callable(s, "env.tools entry") for s in tools]
        modules = list({id(m): m for m in (sys.modules.get(f.__module__) for f in functions) if m is not None}.values())
    if state_fn is None:
        found = [getattr(m, MAKE_STATE) for m in modules if callable(getattr(m, MAKE_STATE, None))]
        if len(found) > 1:
            raise ToolLoadError("env.tools come from several modules with a make_state each; choose one with env.make_state")
        state_fn = found[0] if found else None
    return PythonTools(functions, state_fn)
