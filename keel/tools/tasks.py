"""`data.source: jsonl`: the user's tasks, one JSON object a line.

    {"prompt": "How many customers live in Lyon?", "answer": "3", "gold_calls": [[{"name": "run_sql", "arguments": {"query": "..."}}]], "level": 2}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}], "answer": ["3", "three"]}

- `prompt`, or `messages` (an optional system message, which replaces the env's instructions,
  and one user message);
- `answer`: a string (or number) or a list of accepted strings, the first the primary one
  (F1 is computed against it, EM accepts any); may be omitted when the reward does not need it;
- `gold_calls` (optional): the gold trajectory, one list of calls per assistant turn, each
  `{"name": ..., "arguments": {...}}`; the gold episode makes them turn by turn and then answers
  `<answer>{answer}</answer>`. It feeds SFT warm-start, OPS, ETS, hints and the oracle policy;
  `[]` means "answer without a call";
- `id` (optional; default `<file stem>-<line number>`);
- every other field reaches the reward unchanged as `task.meta["fields"]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keel.errors import UserError, read_user_text
from keel.rundir import parse_jsonl
from keel.types import Task

KNOWN = ("id", "prompt", "messages", "answer", "gold_calls")


class TaskFileError(UserError):
    """A line that is JSON but not a task; the message names the file and line. (A line that is
    not JSON is keel.rundir.parse_jsonl's UserError, in the same form.)"""


def load_jsonl_tasks(path: str | Path) -> list[Task]:
    p = Path(path)
    tasks, seen = [], set()
    for n, row in parse_jsonl(read_user_text(p, "tasks file").split("\n"), p):
        where = f"{p}:{n}"
        if not isinstance(row, dict):
            raise TaskFileError(f"{where}: a task must be a JSON object")
        task = task_from_row(row, f"{p.stem}-{n}", where)
        if task.id in seen:
            raise TaskFileError(f"{where}: duplicate id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks


def task_from_row(row: dict[str, Any], default_id: str, where: str) -> Task:
    system = None
    if "prompt" in row and "messages" in row:
        raise TaskFileError(f"{where}: give prompt or messages, not both")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise TaskFileError(f"{where}: prompt must be a non-empty string")
        question = row["prompt"]
    elif "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise TaskFileError(f"{where}: messages must be a list of {{role, content}} objects")
        roles = [m.get("role") for m in msgs]
        if roles not in (["user"], ["system", "user"]):
            raise TaskFileError(f"{where}: messages must be [system,] user (got roles {roles}); multi-turn conversations are not supported")
        system = msgs[0]["content"] if roles[0] == "system" else None
        question = msgs[-1]["content"]
    else:
        raise TaskFileError(f"{where}: a task needs prompt or messages")
    answers = _answers(row.get("answer"), where)
    gold = row.get("gold_calls")
    if gold is not None:
        gold = _gold(gold, where)
        if not answers:
            raise TaskFileError(f"{where}: gold_calls need an answer (the gold episode ends by answering it)")
    meta: dict[str, Any] = {"fields": {k: v for k, v in row.items() if k not in KNOWN}, "has_gold": gold is not None}
    if system:
        meta["system"] = system
    return Task(id=str(row.get("id", default_id)), question=question, answers=answers, gold_turns=gold or [], kind="jsonl", meta=meta)


def _answers(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise TaskFileError(f"{where}: answer must be a string, a number or a list of them")
        out.append(str(v))
    return out


def _gold(value: Any, where: str) -> list[list[dict[str, Any]]]:
    if not isinstance(value, list):
        raise TaskFileError(f"{where}: gold_calls must be a list of turns, each a list of calls")
    turns = []
    for t, turn in enumerate(value):
        if isinstance(turn, dict):  # a turn of one call written without its list
            turn = [turn]
        if not isinstance(turn, list) or not turn:
            raise TaskFileError(f"{where}: gold_calls[{t}] must be a non-empty list of calls")
        for c in turn:
            if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)):
                raise TaskFileError(f"{where}: gold_calls[{t}] has a call that is not {{\"name\": str, \"arguments\": object}}")
        turns.append([{"name": c["name"], "arguments": c.get("arguments", {})} for c in turn])
    return turns


def has_gold(task: Task) -> bool:
    return bool(task.meta.get("has_gold"))
