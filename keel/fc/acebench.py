"""ACEBench in its released format: loader, scorer and an Env for the normal and special data.

ACEBench (paper A's second benchmark) judges one assistant answer per item: normal items by an
AST-style match of `[ApiName(key=value)]` calls against the answer, special items by fixed
phrases (incomplete: "Missing necessary parameters", error_param: "There is incorrect value",
irrelevant: "the limitations of the function"), agent items by the end state of a sandbox.
Overall = 0.2676·special + 0.578·normal + 0.1545·agent.
Where Keel departs: the scorer is written from ACEBench's published rules (model_eval/checker.py,
eval_main.py), not imported; calls are read by Keel's literal-only parser in any call format.
Agent items need ACEBench's scenario classes, which are not shipped with the data, so Keel does
not run them: `overall/acebench` counts agent as 0 (as missing categories count in BFCL) and
`overall/acebench_no_agent` renormalises the other two weights (0.2676 + 0.578 = 0.8456).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from keel.errors import UserError
from keel.fc.parse import AnswerOnceEpisode
from keel.rundir import iter_jsonl_strict
from keel.types import Task, ToolCall

DEFAULT_DATA_DIR = Path("/work/shared/data/acebench_sample/data_en")
WEIGHTS = {"special": 0.2676, "normal": 0.578, "agent": 0.1545}

INCOMPLETE_PHRASE = "Missing necessary parameters"
ERROR_PARAM_PHRASE = "There is incorrect value"
IRRELEVANT_PHRASE = "the limitations of the function"
IRRELEVANT_ANSWER = "Due to the limitations of the function, I cannot solve this problem."

SYSTEM_PROMPT = (
    "You are an assistant that calls APIs. Read the conversation and answer the user's last request.\n"
    "If the request can be served by the APIs, answer only with the calls.\n"
    f"If a required parameter is missing, answer: \"{INCOMPLETE_PHRASE} (name1, name2) for the api (ApiName)\".\n"
    f"If a parameter value in the request is wrong, answer: \"{ERROR_PARAM_PHRASE} (value) for the parameters (name) in the conversation history.\"\n"
    f"If no API can serve the request, answer: \"{IRRELEVANT_ANSWER}\""
)


def category_of(path: Path) -> str:
    return path.stem.removeprefix("data_")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, row in iter_jsonl_strict(path, "ACEBench data file"):
        if not isinstance(row, dict) or "id" not in row:
            raise UserError(f"{path}:{lineno}: expected an object with an 'id'")
        rows.append(row)
    return rows


def load_acebench(data_dir: str | Path = DEFAULT_DATA_DIR, categories: list[str] | None = None, limit: int | None = None) -> list[Task]:
    """Normal and special items of `data_dir/data_<category>.json` (+ `possible_answer/`) as Tasks.

    The files are JSONL despite the .json name. Agent categories are skipped (see module doc);
    asking for one explicitly is an error. `gold_turns[0]` is the first candidate answer's calls
    (`[]` for special items, whose expected text is `meta["gold_text"]`).
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"ACEBench data directory not found: {root}")
    files = sorted(root.glob("data_*.json"))
    if not files:
        raise FileNotFoundError(f"no data_<category>.json files in {root}")
    available = {category_of(p): p for p in files}
    wanted = categories or [c for c in available if not c.startswith("agent")]
    tasks: list[Task] = []
    for cat in wanted:
        if cat.startswith("agent"):
            raise UserError(f"ACEBench category {cat!r} needs ACEBench's sandbox classes, which Keel does not ship")
        if cat not in available:
            raise FileNotFoundError(f"{root}/data_{cat}.json not found (have: {sorted(available)})")
        answer_path = root / "possible_answer" / f"data_{cat}.json"
        if not answer_path.exists():
            raise FileNotFoundError(f"ACEBench answers not found: {answer_path}")
        answers = {a["id"]: a.get("ground_truth") for a in _read_jsonl(answer_path)}
        rows = _read_jsonl(available[cat])
        if limit is not None:
            rows = rows[:limit]
        for row in rows:
            if row["id"] not in answers:
                raise UserError(f"{answer_path}: no answer for {row['id']}")
            for key in ("question", "function"):
                if key not in row:
                    raise UserError(f"{available[cat]}: item {row['id']} has no {key!r}")
            tasks.append(_task(cat, row, answers[row["id"]]))
    return tasks


def _task(cat: str, row: dict[str, Any], answer: Any) -> Task:
    functions = [_normalise_function(f) for f in row["function"]]
    meta = {"category": cat, "functions": functions, "ground_truth": answer, "time": row.get("time", ""), "classes": [f["name"] for f in functions]}
    if cat.startswith("special"):
        meta["gold_text"] = special_answer(cat, answer)
        gold: list[dict[str, Any]] = []
    else:
        first = answer[0] if isinstance(answer, list) else answer
        if not isinstance(first, dict):
            raise UserError(f"ACEBench {row['id']}: normal answer must be {{ApiName: {{args}}}}, got {type(first).__name__}")
        names = {f["name"] for f in functions}
        gold = [{"name": real_name(n, names), "arguments": a} for n, a in first.items()]
    return Task(id=row["id"], question=row["question"], answers=[], gold_turns=[gold], kind=cat, meta=meta)


def real_name(answer_key: str, names: set[str]) -> str:
    """ACEBench keys repeated calls of one API as `Api_1`, `Api_2`, ...; the API is `Api`."""
    if answer_key in names:
        return answer_key
    base = re.sub(r"_\d+$", "", answer_key)
    return base if base in names else answer_key


def _normalise_function(f: dict[str, Any]) -> dict[str, Any]:
    """Schemas use "parameters" or "arguments", and "dict" or "object"; keep one spelling."""
    params = f.get("parameters", f.get("arguments", {})) or {}
    return {"name": f["name"], "description": f.get("description", ""), "parameters": params}


def special_answer(cat: str, answer: Any) -> str:
    """A reply that passes ACEBench's rule for a special item (used as the oracle's text)."""
    if "incomplete" in cat:
        return " ".join(f"{INCOMPLETE_PHRASE} ({', '.join(str(v) for v in values)}) for the api ({name})." for name, values in answer.items())
    if "error" in cat:
        return " ".join(f"{ERROR_PARAM_PHRASE} ({', '.join(str(v) for v in values)}) for the parameters ({name}) in the conversation history." for name, values in answer.items())
    return IRRELEVANT_ANSWER


# ---------------------------------------------------------------------------------------------
# Scoring


def standardize(s: str) -> str:
    """ACEBench / BFCL string standardisation: drop spaces and , . / - _ * ^, lowercase,
    single quotes as double."""
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def check_special(cat: str, answer: Any, text: str) -> tuple[bool, str | None]:
    """ACEBench's special rules: the phrase, and every name / value of the answer, in the text."""
    if "incomplete" in cat:
        if INCOMPLETE_PHRASE not in text:
            return False, "error_detection"
        for name, values in answer.items():
            if name not in text or any(v not in text for v in values):
                return False, "error_correction"
        return True, None
    if "error" in cat:
        if ERROR_PARAM_PHRASE not in text:
            return False, "error_detection"
        for values in answer.values():
            if any(v not in text for v in values):
                return False, "error_correction"
        return True, None
    return (IRRELEVANT_PHRASE in text), (None if IRRELEVANT_PHRASE in text else "error_detection")


_TYPES = {"string": str, "integer": int, "number": (int, float), "float": (int, float), "boolean": bool, "array": list, "list": list, "tuple": list, "object": dict, "dict": dict}


def _value_ok(value: Any, gold: Any, schema: dict[str, Any]) -> bool:
    if value == "true":
        value = True
    if value == "false":
        value = False
    if isinstance(value, tuple):
        value = list(value)
    kind = schema.get("type", "") if isinstance(schema, dict) else ""
    if isinstance(gold, dict):
        return _dict_ok(value, gold)
    if isinstance(gold, list):
        if not isinstance(value, list) or len(value) != len(gold):
            return False
        if gold and all(isinstance(g, dict) for g in gold):
            return all(_dict_ok(v, g) for v, g in zip(value, gold))
        norm = lambda xs: [standardize(x) if isinstance(x, str) else x for x in xs]  # noqa: E731
        return norm(value) == norm(gold)
    if isinstance(gold, str):
        # Substring match after standardisation, as ACEBench does outside the agent data.
        return isinstance(value, str) and standardize(gold) in standardize(value)
    if isinstance(gold, bool) or isinstance(value, bool):
        return value is gold
    if isinstance(gold, (int, float)):
        expected = _TYPES.get(kind)
        if expected is int and isinstance(value, float):
            return False
        return isinstance(value, (int, float)) and float(value) == float(gold)
    return value == gold


def _dict_ok(value: Any, gold: dict[str, Any]) -> bool:
    if not isinstance(value, dict) or len(value) != len(gold):
        return False
    for k, v in value.items():
        if k not in gold:
            return False
        g = gold[k]
        if isinstance(g, dict):
            if not _dict_ok(v, g):
                return False
            continue
        if v == "true":
            v = True
        if v == "false":
            v = False
        sv = standardize(v) if isinstance(v, str) else v
        sg = standardize(g) if isinstance(g, str) else g
        if str(sg) not in str(sv):  # ACEBench compares nested leaves as text
            return False
    return True


def _function_ok(schema: dict[str, Any], args: dict[str, Any], gold_args: dict[str, Any]) -> bool:
    params = schema.get("parameters") or {}
    props = params.get("properties", {}) if isinstance(params, dict) else {}
    if not args and not props:
        return True
    if not args or not props:
        return gold_args == {} and not args
    for p in params.get("required", []):
        if p not in args:
            return False
    for p, v in args.items():
        if p not in props or p not in gold_args:
            return False
        if not _value_ok(v, gold_args[p], props[p]):
            return False
    return True


def check_normal(task: Task, calls: list[ToolCall]) -> tuple[bool, str | None]:
    """ACEBench's normal rule: as many calls as answer functions, each answer function matched
    by a call of that name whose arguments pass; any one candidate answer may match."""
    if not calls or any(c.error for c in calls):
        return False, "wrong_output_format"
    answer = task.meta["ground_truth"]
    candidates = answer if isinstance(answer, list) else [answer]
    schemas = {f["name"]: f for f in task.meta["functions"]}
    error = "wrong functions number"
    for cand in candidates:
        if len(calls) != len(cand):
            continue
        unused = list(calls)
        ok = True
        for key, gold_args in cand.items():
            name = real_name(key, set(schemas))
            match = next((c for c in unused if c.name == name and name in schemas and _function_ok(schemas[name], c.arguments, gold_args)), None)
            if match is None:
                ok, error = False, "wrong_function_or_value"
                break
            unused.remove(match)
        if ok:
            return True, None
    return False, error


def score_answer(task: Task, text: str, calls: list[ToolCall]) -> tuple[bool, str | None]:
    cat = task.meta["category"]
    if cat.startswith("special"):
        if calls and all(c.error is None for c in calls):
            return False, "called_a_function"
        return check_special(cat, task.meta["ground_truth"], text)
    return check_normal(task, calls)


def category_accuracies(rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """Per category accuracy as ACEBench computes it: the item mean, except normal_multi_turn_*,
    where a conversation (id ..._<conversation>_<turn>) counts only if all its items pass."""
    by_cat: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    acc, counts = {}, {}
    for cat, rs in by_cat.items():
        counts[cat] = len(rs)
        if "multi_turn" in cat:
            convs: dict[str, bool] = {}
            for r in rs:
                conv = r["id"].rsplit("_", 2)[-2]
                convs[conv] = convs.get(conv, True) and r["valid"]
            acc[cat] = sum(convs.values()) / len(convs)
        else:
            acc[cat] = sum(r["valid"] for r in rs) / len(rs)
    return acc, counts


def acebench_overall(acc: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """Group scores (entry-weighted over the group's categories) and the weighted overall.

    Worked example: normal 0.5 over 10 items + 1.0 over 30 items -> (5 + 30) / 40 = 0.875;
    special 1.0; overall = 0.2676·1.0 + 0.578·0.875 + 0.1545·0 = 0.77335.
    """
    groups: dict[str, float] = {}
    for g in ("normal", "special"):
        cats = [c for c in acc if c.startswith(g)]
        n = sum(counts[c] for c in cats)
        if n:
            groups[g] = sum(acc[c] * counts[c] for c in cats) / n
    out = {f"overall/{g}": v for g, v in groups.items()}
    s, n = groups.get("special", 0.0), groups.get("normal", 0.0)
    out["overall/acebench"] = WEIGHTS["special"] * s + WEIGHTS["normal"] * n
    out["overall/acebench_no_agent"] = out["overall/acebench"] / (WEIGHTS["special"] + WEIGHTS["normal"])
    return out


# ---------------------------------------------------------------------------------------------
# Env


class AceBenchEpisode(AnswerOnceEpisode):
    """One ACEBench item: the first assistant message is the answer; judged at close()."""

    def judge(self) -> tuple[bool, str | None]:
        return score_answer(self.task, self.text or "", self.calls)


class AceBenchEnv:
    name = "acebench"

    def __init__(self, call_format: str = "json"):
        self.call_format = call_format

    def tools(self, task: Task) -> list[dict[str, Any]]:
        if self.call_format != "json":
            return []
        return [{"type": "function", "function": f} for f in task.meta["functions"]]

    def system_prompt(self, task: Task) -> str:
        prompt = SYSTEM_PROMPT
        if self.call_format != "json":
            prompt += "\nCall format: [ApiName(key1='value1', key2='value2'), ApiName2(key='value')]"
            if self.call_format == "python_tagged":
                prompt += " inside <TOOLCALL></TOOLCALL>"
            prompt += "\nAPIs:\n" + json.dumps(task.meta["functions"], ensure_ascii=False)
        if task.meta.get("time"):
            prompt += "\n" + task.meta["time"]
        return prompt

    def user_message(self, task: Task) -> str:
        return task.question

    def start(self, task: Task) -> AceBenchEpisode:
        return AceBenchEpisode(task, self.call_format)


def write_acebench_dir(tasks_by_category: dict[str, list[tuple[dict[str, Any], Any]]], root: str | Path) -> Path:
    """Write items in ACEBench's released layout (for tests and synthetic data):
    {category: [(question_row, ground_truth)]} -> root/data_<category>.json + possible_answer/."""
    root = Path(root)
    (root / "possible_answer").mkdir(parents=True, exist_ok=True)
    for cat, items in tasks_by_category.items():
        with open(root / f"data_{cat}.json", "w", encoding="utf-8") as q, open(root / "possible_answer" / f"data_{cat}.json", "w", encoding="utf-8") as a:
            for row, gt in items:
                q.write(json.dumps(row, ensure_ascii=False) + "\n")
                a.write(json.dumps({"id": row["id"], "ground_truth": gt}, ensure_ascii=False) + "\n")
    return root
