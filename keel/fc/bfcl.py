"""BFCL-V3 multi-turn as an RL environment, on bfcl-eval's own data, simulators and checker.

Paper A trains on BFCL-V3 multi-turn (base, miss_func, miss_param, long_context) with a binary
reward: 1 when BFCL's multi-turn checker says the episode is valid. This module serves those
entries turn by turn (several tool steps per user turn, BFCL's 20-step limit), executes calls on
bfcl-eval's simulators and asks bfcl-eval's `multi_turn_checker` for the verdict.
Where Keel departs from bfcl-eval's own inference loop:
- model text is never eval()'d: calls are parsed literal-only (keel.fc.parse), the name must be a
  public method of the entry's involved classes, and only `canonical_call(...)` reaches
  bfcl-eval's executor (which eval()s it);
- bfcl-eval caches simulator instances in module globals keyed by (model_name, entry id); every
  episode and every check uses a fresh 32-hex-digit key and deletes its globals afterwards;
- three argument values that would make a simulator run without bound (big-integer `power`,
  sequence × int in `multiply`, `square_root` precision) are refused with a structured error,
  and each call runs inside `decimal.localcontext()` because `square_root` sets the precision
  of the process-wide decimal context;
- a step that mixes valid and malformed calls executes the valid ones (BFCL's decoder would drop
  the whole step), and calls that fail parsing or whitelisting are not shown to the checker.
"""

from __future__ import annotations

import decimal
import inspect
import json
import math
import re
import sys
import types
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

from keel.errors import UserError
from keel.rundir import iter_jsonl_strict
from keel.fc.parse import CALL_FORMATS, AnswerOnceEpisode, CallParseError, canonical_call, parse_calls, parse_python_calls
from keel.types import Observation, Task, ToolCall

import bfcl_eval
from bfcl_eval.constants import default_prompts as _prompts
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, MULTI_TURN_FUNC_DOC_FILE_MAPPING
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as _mt_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

MULTI_TURN_CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
# Single-turn AST categories Keel scores (Python only: Java/JavaScript need BFCL's string-typed
# argument convention, which Keel's parser does not produce).
SINGLE_TURN_CATEGORIES = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    "live_relevance",
)
STEP_LIMIT = _prompts.MAXIMUM_STEP_LIMIT  # 20: BFCL force-quits a turn after its 21st step
DATA_DIR = Path(bfcl_eval.__file__).parent / "data"
MODEL_NAME_PREFIX = "keel_"  # + 32 hex digits: no key is a prefix of another


def _data_file(category: str, answer: bool = False) -> Path:
    return DATA_DIR / ("possible_answer" if answer else "") / f"BFCL_v4_{category}.json"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in iter_jsonl_strict(path, "BFCL data file")]


@lru_cache(maxsize=None)
def func_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """bfcl-eval's function docs of one simulator class (BFCL's own JSON format)."""
    if class_name not in MULTI_TURN_FUNC_DOC_FILE_MAPPING:
        raise UserError(f"unknown BFCL class {class_name!r}; known: {sorted(MULTI_TURN_FUNC_DOC_FILE_MAPPING)}")
    return tuple(_read_jsonl(DATA_DIR / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]))


@lru_cache(maxsize=None)
def class_methods(class_name: str) -> dict[str, tuple[str, ...]]:
    """Public methods of a simulator class -> their parameter names in order (BFCL's whitelist:
    `inspect.getmembers(instance, ismethod)` without leading underscores)."""
    import importlib

    module = importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name])
    instance = getattr(module, class_name)()
    out = {}
    for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
        if name.startswith("_"):
            continue
        params = [p.name for p in inspect.signature(method).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        out[name] = tuple(params)
    return out


def allowed_methods(involved_classes: list[str]) -> dict[str, tuple[str, ...]]:
    """Method name -> parameter names for an entry; later classes win a name clash, as in BFCL."""
    out: dict[str, tuple[str, ...]] = {}
    for c in involved_classes:
        out.update(class_methods(c))
    return out


def to_openai_tool(doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc in the OpenAI tool format the Hermes template lists ("dict" -> "object")."""

    def fix(schema: Any) -> Any:
        if isinstance(schema, dict):
            out = {k: fix(v) for k, v in schema.items()}
            if out.get("type") == "dict":
                out["type"] = "object"
            if out.get("type") == "float":
                out["type"] = "number"
            if out.get("type") == "tuple":
                out["type"] = "array"
            return out
        if isinstance(schema, list):
            return [fix(s) for s in schema]
        return schema

    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""), "parameters": fix(doc.get("parameters", {}))}}


# ---------------------------------------------------------------------------------------------
# Tasks


def gold_call_dicts(call_strings: list[str], involved_classes: list[str]) -> list[dict[str, Any]]:
    """BFCL ground-truth strings (`"sort('a.pdf')"`) as {"name", "arguments"} dicts, positional
    arguments named from the simulator's signature."""
    methods = allowed_methods(involved_classes)
    out = []
    for s in call_strings:
        for name, args in parse_python_calls(s, lambda n: list(methods.get(n, ())) or None):
            out.append({"name": name, "arguments": args})
    return out


def load_bfcl_multi_turn(category: str, limit: int | None = None, ids: list[str] | None = None) -> list[Task]:
    """The entries of one multi-turn category as Tasks.

    `gold_turns[t]` is the gold calls of user turn t (`[]` for the turns of miss_func / miss_param
    where the model should ask or answer without a call). `meta` holds the bfcl-eval entry with
    its function docs (miss_func's held-back docs moved to `missed_function`) and BFCL's raw
    ground-truth strings, which are what the checker replays.
    """
    cat = category.removeprefix("multi_turn_")
    if cat not in MULTI_TURN_CATEGORIES:
        raise UserError(f"unknown BFCL multi-turn category {category!r}; expected one of {MULTI_TURN_CATEGORIES}")
    from bfcl_eval.utils import populate_test_cases_with_predefined_functions

    entries = _read_jsonl(_data_file(f"multi_turn_{cat}"))
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(_data_file(f"multi_turn_{cat}", answer=True))}
    if ids is not None:
        wanted = set(ids)
        entries = [e for e in entries if e["id"] in wanted]
    if limit is not None:
        entries = entries[:limit]
    entries = populate_test_cases_with_predefined_functions(entries)
    tasks = []
    for e in entries:
        if e["id"] not in answers:
            raise UserError(f"{_data_file(f'multi_turn_{cat}', answer=True)}: no ground truth for {e['id']}")
        gt = answers[e["id"]]
        if len(gt) != len(e["question"]):
            raise UserError(f"{e['id']}: {len(gt)} ground-truth turns for {len(e['question'])} user turns")
        tasks.append(
            Task(
                id=e["id"],
                question=_turn_text(e["question"][0]),
                answers=[],
                gold_turns=[gold_call_dicts(turn, e["involved_classes"]) for turn in gt],
                kind=f"multi_turn_{cat}",
                meta={"category": f"multi_turn_{cat}", "entry": e, "ground_truth": gt, "involved_classes": list(e["involved_classes"])},
            )
        )
    return tasks


def _turn_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(m["content"] for m in messages if m.get("role") == "user")


# ---------------------------------------------------------------------------------------------
# Prompts


def system_prompt_text(functions: list[dict[str, Any]], call_format: str) -> str:
    """BFCL's own prompting system prompt (style "classic", plaintext) for the given call format.

    For "json" the function list is left to the Hermes template (`Env.tools`), so only the persona,
    task and multi-turn behaviour lines are returned.
    """
    style = _prompts.PROMPT_STYLE_TEMPLATES["classic"]
    if call_format == "json":
        return f"{style['persona']}{style['task']}\n\n{style['multiturn_behavior']}"
    key = "tool_call_with_tag" if call_format == "python_tagged" else "tool_call_no_tag"
    fmt = style[key].format(output_format=_prompts.OUTPUT_FORMAT_MAPPING["python"], param_types=_prompts.PARAM_TYPE_MAPPING["python"])
    tools = style["available_tools"].format(format="JSON", functions=json.dumps(functions, ensure_ascii=False))
    return _prompts.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"], task=style["task"], tool_call_format=fmt, multiturn_behavior=style["multiturn_behavior"], available_tools=tools
    )


def holdout_message(docs: list[dict[str, Any]], call_format: str) -> str:
    """BFCL's miss_func follow-up turn: the held-back docs, then its fixed message."""
    shown = [to_openai_tool(d) for d in docs] if call_format == "json" else docs
    return _prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=json.dumps(shown, ensure_ascii=False))


# ---------------------------------------------------------------------------------------------
# Execution


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _guard_power(a: dict[str, Any]) -> str | None:
    base, exp = a.get("base"), a.get("exponent")
    if isinstance(base, int) and isinstance(exp, int) and not isinstance(exp, bool) and abs(base) > 1 and exp > 0:
        # Python computes int ** int exactly; 10 ** 10**15 would never return. 10**5 result bits
        # is ~30,000 decimal digits, far beyond any BFCL task.
        if exp * math.log2(abs(base)) > 1e5:
            return "power result too large"
    return None


def _guard_multiply(a: dict[str, Any]) -> str | None:
    x, y = a.get("a"), a.get("b")
    if (isinstance(x, (str, list, tuple)) and isinstance(y, int)) or (isinstance(y, (str, list, tuple)) and isinstance(x, int)):
        return "multiply expects numbers, not a sequence and an integer"
    return None


def _guard_square_root(a: dict[str, Any]) -> str | None:
    p = a.get("precision")
    if isinstance(p, int) and not isinstance(p, bool) and p > 10_000:
        return "square_root precision above 10000"
    return None


# Argument values that make a MathAPI method run without bound. Keyed by method name, applied
# when the name resolves to MathAPI (the only class with these names).
COST_GUARDS = {"power": _guard_power, "multiply": _guard_multiply, "square_root": _guard_square_root}


def _instance_prefix(model_name: str) -> str:
    return re.sub(r"[-./:]", "_", model_name) + "_"


def purge_instances(model_name: str) -> int:
    """Delete bfcl-eval's cached simulator instances of one model name; returns how many."""
    prefix = _instance_prefix(model_name)
    g = vars(_mt_utils)
    doomed = [k for k in g if k.startswith(prefix)]
    for k in doomed:
        del g[k]
    return len(doomed)


def cached_instance_count() -> int:
    """Simulator instances Keel has left in bfcl-eval's module globals (0 when all is released)."""
    return sum(1 for k in vars(_mt_utils) if k.startswith(MODEL_NAME_PREFIX))


def new_model_name() -> str:
    return MODEL_NAME_PREFIX + uuid.uuid4().hex


def is_long_context(category: str) -> bool:
    return "long_context" in category or "composite" in category  # bfcl-eval's own test


def execute_canonical(call: str, entry: dict[str, Any], model_name: str, category: str) -> str:
    """Run one canonical call string on the entry's simulators under `model_name`."""
    with decimal.localcontext():
        results, _ = _mt_utils.execute_multi_turn_func_call(
            func_call_list=[call],
            initial_config=entry.get("initial_config", {}),
            involved_classes=entry["involved_classes"],
            model_name=model_name,
            test_entry_id=entry["id"],
            long_context=is_long_context(category),
            is_evaL_run=False,
        )
    return results[0]


def validate_call(call: ToolCall, methods: dict[str, tuple[str, ...]]) -> tuple[str | None, Observation | None]:
    """(canonical string, None) for a call that may run, else (None, error observation)."""
    if call.error:
        return None, Observation(text=f"Error: the call could not be parsed ({call.error}).", ok=False, error=call.error)
    if call.name not in methods:
        shown = call.name[:60] if isinstance(call.name, str) else ""
        return None, Observation(text=f"Error: unknown function {shown!r}.", ok=False, error="unknown_tool")
    try:
        text = canonical_call(call.name, call.arguments)
    except CallParseError as exc:
        return None, Observation(text=f"Error: bad arguments for {call.name} ({exc.code}).", ok=False, error="bad_arguments")
    guard = COST_GUARDS.get(call.name)
    if guard is not None:
        reason = guard(call.arguments)
        if reason:
            return None, Observation(text=f"Error: {reason}.", ok=False, error="argument_out_of_range")
    return text, None


class BfclEpisode:
    """One rollout of one BFCL multi-turn entry. See `keel.types.Episode`.

    Bookkeeping is per user turn, per step (one assistant message with calls), per call, exactly
    the nesting bfcl-eval's checker reads (`list[list[list[str]]]`). A rollout engine that calls
    `begin_step()` before executing the calls of each assistant message gets BFCL's step
    grouping; without it every call counts as its own step (the verdict is the same: the checker
    flattens the steps of a turn; only the 20-step limit is reached sooner).
    After `close()`, `info` holds `checker_valid` (bool) and the checker's error type.
    """

    def __init__(self, task: Task, call_format: str = "json", step_limit: int = STEP_LIMIT):
        self.task = task
        self.entry = task.meta["entry"]
        self.category = task.meta["category"]
        self.call_format = call_format
        self.step_limit = step_limit
        self.methods = allowed_methods(self.entry["involved_classes"])
        self.model_name = new_model_name()
        self.n_turns = len(self.entry["question"])
        self.turn = 0
        self.turn_calls: list[list[list[str]]] = [[]]
        self.steps_in_turn = 0
        self.force_quit = False
        self.finished = False
        self.closed = False
        self._explicit_steps = False
        self._step_open = False
        self.info: dict[str, Any] = {}

    def positional_names(self, name: str) -> list[str] | None:
        params = self.methods.get(name)
        return list(params) if params is not None else None

    def parse(self, text: str) -> list[ToolCall]:
        """The calls of one assistant turn in this episode's call format (never raises)."""
        return parse_calls(text, self.call_format, self.positional_names)

    def begin_step(self) -> None:
        self._explicit_steps = True
        self._step_open = False

    def _open_step(self) -> bool:
        """Start a step if none is open; False when BFCL's step limit forbids it."""
        if self._step_open and self._explicit_steps:
            return True
        if self.steps_in_turn > self.step_limit:
            self.force_quit = True
            return False
        self.steps_in_turn += 1
        self.turn_calls[-1].append([])
        self._step_open = True
        return True

    def execute(self, call: ToolCall) -> Observation:
        try:
            return self._execute(call)
        except Exception as exc:  # a simulator bug must not end a long run
            return Observation(text=f"Error: tool failed ({type(exc).__name__}).", ok=False, error="env_exception")

    def _execute(self, call: ToolCall) -> Observation:
        if self.closed or self.finished:
            return Observation(text="Error: the conversation is over.", ok=False, error="episode_over")
        if self.force_quit or not self._open_step():
            return Observation(text=f"Model has been forced to quit after {self.step_limit} steps.", ok=False, error="step_limit")
        canonical, error = validate_call(call, self.methods)
        if error is not None:
            return error
        result = execute_canonical(canonical, self.entry, self.model_name, self.category)
        self.turn_calls[-1][-1].append(canonical)
        failed = result.startswith("Error during execution")
        if not self._explicit_steps:
            self._step_open = False
        return Observation(text=result, ok=not failed, error="tool_error" if failed else None)

    def next_user_message(self) -> str | None:
        self._step_open = False
        if self.closed or self.finished:
            return None
        if self.force_quit or self.steps_in_turn > self.step_limit:
            self.force_quit = True
            return None
        self.turn += 1
        if self.turn >= self.n_turns:
            self.turn = self.n_turns - 1
            self.finished = True
            return None
        self.turn_calls.append([])
        self.steps_in_turn = 0
        holdout = self.entry.get("missed_function", {})
        if str(self.turn) in holdout:
            return holdout_message(holdout[str(self.turn)], self.call_format)
        return _turn_text(self.entry["question"][self.turn])

    def model_turn_calls(self) -> list[list[list[str]]]:
        return [[step for step in turn if step] for turn in self.turn_calls]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            valid, details = bfcl_check(self.task, self.model_turn_calls())
            self.info = {
                "checker_valid": valid,
                "checker_error_type": details.get("error_type"),
                "force_quit": self.force_quit,
                "turns_reached": len(self.turn_calls),
                "model_turn_calls": self.model_turn_calls(),
            }
        finally:
            purge_instances(self.model_name)


def bfcl_check(task: Task, model_turn_calls: list[list[list[str]]]) -> tuple[bool, dict[str, Any]]:
    """bfcl-eval's multi-turn verdict for canonical call strings, per user turn, per step.

    Applies the two checks bfcl-eval's runner makes before its checker
    (`eval_runner._evaluate_single_multi_turn_entry`: fewer turns than the gold means the model
    was force-terminated; empty steps are dropped), then `multi_turn_checker`. Every string is
    re-parsed and must equal its canonical form and name a whitelisted method, so nothing but a
    canonical literal call reaches bfcl-eval's eval(). Returns (valid, details) where details has
    `error_type` and `error_message` (None / "" when valid).
    """
    entry = task.meta["entry"]
    gold = task.meta["ground_truth"]
    if not isinstance(model_turn_calls, list) or len(model_turn_calls) != len(gold):
        n = len(model_turn_calls) if isinstance(model_turn_calls, list) else "?"
        return False, {"error_type": "multi_turn:force_terminated", "error_message": f"{n} model turns for {len(gold)} gold turns"}
    methods = allowed_methods(entry["involved_classes"])
    decoded: list[list[list[str]]] = []
    for turn in model_turn_calls:
        steps = []
        for step in turn if isinstance(turn, list) else []:
            if not step:
                continue
            for s in step:
                if not _is_canonical(s, methods):
                    return False, {"error_type": "keel:non_canonical_call", "error_message": f"refused to check {str(s)[:80]!r}"}
            steps.append(list(step))
        decoded.append(steps)
    model_name = new_model_name()
    try:
        with decimal.localcontext():
            result = multi_turn_checker(decoded, gold, entry, task.meta["category"], model_name)
    except Exception as exc:  # bfcl-eval asserts on instance sets; a crash is a failed check
        result = {"valid": False, "error_type": f"checker_exception:{type(exc).__name__}", "error_message": str(exc)[:200]}
    finally:
        purge_instances(model_name)
    valid = bool(result.get("valid"))
    return valid, {"error_type": None if valid else result.get("error_type"), "error_message": "" if valid else str(result.get("error_message", ""))[:300]}


def _is_canonical(s: Any, methods: dict[str, tuple[str, ...]]) -> bool:
    if not isinstance(s, str):
        return False
    try:
        parsed = parse_python_calls(s)
    except CallParseError:
        return False
    if len(parsed) != 1 or parsed[0][0] not in methods:
        return False
    try:
        return canonical_call(*parsed[0]) == s
    except CallParseError:
        return False


class BfclEnv:
    """BFCL-V3 multi-turn as a Keel Env. `call_format` picks the prompt and parser (format OOD)."""

    name = "bfcl"

    def __init__(self, call_format: str = "json", step_limit: int = STEP_LIMIT):
        if call_format not in CALL_FORMATS:
            raise UserError(f"unknown call_format {call_format!r}; expected one of {', '.join(CALL_FORMATS)}")
        self.call_format = call_format
        self.step_limit = step_limit

    def tools(self, task: Task) -> list[dict[str, Any]]:
        if self.call_format != "json":
            return []  # listed inside the system prompt, as BFCL's prompting mode does
        return [to_openai_tool(d) for d in task.meta["entry"]["function"]]

    def system_prompt(self, task: Task) -> str:
        return system_prompt_text(task.meta["entry"]["function"], self.call_format)

    def user_message(self, task: Task) -> str:
        return _turn_text(task.meta["entry"]["question"][0])

    def start(self, task: Task) -> BfclEpisode:
        return BfclEpisode(task, self.call_format, self.step_limit)


# ---------------------------------------------------------------------------------------------
# Single-turn AST categories


def _ast_checker():
    """bfcl-eval's AST checker. Its module imports `model_config`, which imports every API
    client (anthropic, openai, ...) only to read `underscore_to_dot` for dotted names; when that
    import fails, a stand-in `model_config` whose every model has underscore_to_dot=False is put
    in its place for the import (Keel's parser keeps dots in names)."""
    name = "bfcl_eval.constants.model_config"
    try:
        from bfcl_eval.eval_checker.ast_eval import ast_checker as mod

        return mod
    except ImportError:
        pass
    for k in [k for k in sys.modules if k.startswith("bfcl_eval.eval_checker.ast_eval.ast_checker")]:
        del sys.modules[k]

    class _AnyModel(dict):
        def __missing__(self, key):
            return types.SimpleNamespace(underscore_to_dot=False)

    stand_in = types.ModuleType(name)
    stand_in.MODEL_CONFIG_MAPPING = _AnyModel()
    saved = sys.modules.get(name)
    sys.modules[name] = stand_in
    try:
        from bfcl_eval.eval_checker.ast_eval import ast_checker as mod
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    return mod


def load_bfcl_single_turn(category: str, limit: int | None = None) -> list[Task]:
    """A single-turn category as Tasks; `meta["possible_answer"]` is BFCL's answer (None for the
    relevance / irrelevance categories, which have none)."""
    if category not in SINGLE_TURN_CATEGORIES:
        raise UserError(f"unknown BFCL single-turn category {category!r}; expected one of {SINGLE_TURN_CATEGORIES}")
    entries = _read_jsonl(_data_file(category))
    answers = {}
    if "relevance" not in category:
        answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(_data_file(category, answer=True))}
    if limit is not None:
        entries = entries[:limit]
    tasks = []
    for e in entries:
        messages = e["question"][0]
        pa = answers.get(e["id"])
        if "relevance" not in category and pa is None:
            raise UserError(f"{_data_file(category, answer=True)}: no ground truth for {e['id']}")
        required = {f["name"]: tuple(f.get("parameters", {}).get("required", [])) for f in e["function"]}
        gold = [{"name": n, "arguments": oracle_arguments(a, required.get(n, ()))} for d in (pa or []) for n, a in d.items()]
        tasks.append(
            Task(
                id=e["id"],
                question=_turn_text(messages),
                answers=[],
                gold_turns=[gold],
                kind=category,
                meta={"category": category, "entry": e, "possible_answer": pa, "system": "\n".join(m["content"] for m in messages if m.get("role") == "system")},
            )
        )
    return tasks


def oracle_arguments(param_options: dict[str, list[Any]], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """One concrete argument set out of BFCL's possible answer: each parameter maps to a list of
    accepted values, "" meaning "may be omitted"; a dict value's keys map, one level deep, to
    lists of accepted values again (bfcl-eval's dict_checker / list_dict_checker).

    A parameter the function doc marks required gets its first non-"" accepted value; an
    optional one that may be omitted is omitted (a few answers list values for parameters the
    doc lacks, e.g. parallel_multiple_12, and accept their omission); else the first value.
    """
    out = {}
    for k, options in param_options.items():
        if not isinstance(options, list):
            out[k] = _resolve(options)
            continue
        values = [o for o in options if o != ""]
        if "" in options and k not in required:
            continue
        if values:
            out[k] = _resolve(values[0])
        elif options:
            out[k] = ""
    return out


def _first_option(options: Any) -> Any:
    if not isinstance(options, list):
        return options
    for o in options:
        if o != "":
            return o
    return _OMIT


_OMIT = object()


def _resolve(v: Any) -> Any:
    """A chosen value: dicts (also inside lists) have option lists per key; pick within them."""
    if isinstance(v, dict):
        return {k: o for k, o in ((k, _first_option(opts)) for k, opts in v.items()) if o is not _OMIT}
    if isinstance(v, list):
        return [_resolve(e) if isinstance(e, dict) else e for e in v]
    return v


def check_single_turn(task: Task, calls: list[ToolCall]) -> tuple[bool, dict[str, Any]]:
    """bfcl-eval's verdict for one single-turn answer (its AST checker; for (ir)relevance, its rule:
    irrelevance passes when no call decodes, relevance when at least one does)."""
    category = task.meta["category"]
    decoded_ok = bool(calls) and all(c.error is None for c in calls)
    if "irrelevance" in category:
        return (not decoded_ok), {"error_type": None if not decoded_ok else "irrelevance_error:decoder_success"}
    if "relevance" in category:
        return decoded_ok, {"error_type": None if decoded_ok else "relevance_error:decoder_failed"}
    if not decoded_ok:
        return False, {"error_type": "ast_decoder:decoder_failed"}
    from bfcl_eval.constants.enums import Language

    model_output = [{c.name: json.loads(json.dumps(c.arguments))} for c in calls]
    try:
        result = _ast_checker().ast_checker(task.meta["entry"]["function"], model_output, task.meta["possible_answer"], Language.PYTHON, category, "keel_fc")
    except Exception as exc:
        result = {"valid": False, "error_type": f"checker_exception:{type(exc).__name__}"}
    valid = bool(result.get("valid"))
    return valid, {"error_type": None if valid else result.get("error_type")}


class SingleTurnEpisode(AnswerOnceEpisode):
    """One single-turn answer: the calls of the first assistant message are recorded (not run:
    BFCL's single-turn categories are scored by AST, without execution) and judged at close()."""

    def judge(self) -> tuple[bool, str | None]:
        valid, details = check_single_turn(self.task, self.calls)
        return valid, details.get("error_type")


class BfclSingleTurnEnv:
    """BFCL's single-turn AST categories behind the Env interface (one assistant message)."""

    name = "bfcl_single_turn"

    def __init__(self, call_format: str = "json"):
        self.call_format = call_format

    def tools(self, task: Task) -> list[dict[str, Any]]:
        return [to_openai_tool(d) for d in task.meta["entry"]["function"]] if self.call_format == "json" else []

    def system_prompt(self, task: Task) -> str:
        style = _prompts.PROMPT_STYLE_TEMPLATES["classic"]
        if self.call_format == "json":
            base = f"{style['persona']}{style['task']}"
        else:
            base = system_prompt_text(task.meta["entry"]["function"], self.call_format)
        extra = task.meta.get("system") or ""
        return base + ("\n\n" + extra if extra else "")

    def user_message(self, task: Task) -> str:
        return task.question

    def start(self, task: Task) -> SingleTurnEpisode:
        return SingleTurnEpisode(task, self.call_format)
