"""A learnable multi-turn function-calling task on BFCL's own simulators, for CPU-scale RL.

BFCL-V3 multi-turn is far beyond a 135M model (paper A's 1.5B model scores 3.5 with GRPO
alone), so a reward curve there is flat. This generator writes short conversations over the
same simulators (MathAPI, GorillaFileSystem) with templated user turns, 3–5 offered functions
and 1–2 calls per turn, in exactly the BFCL entry format: the same BfclEnv runs them and the
same bfcl-eval checker scores them, so a policy trained here is scored by the real machinery.
Departure: the data are Keel's, not BFCL's; they test the pipeline, not BFCL ability.
"""

from __future__ import annotations

import random
from typing import Any

from keel.fc.bfcl import BfclEnv, func_docs, gold_call_dicts
from keel.fc.parse import canonical_call
from keel.types import Task

MATH_FUNCTIONS = ("add", "subtract", "multiply")
FS_FUNCTIONS = ("cd", "ls", "mkdir", "touch", "cat")
_FOLDERS = ("docs", "reports", "photos", "music", "notes")
_FILES = ("todo.txt", "summary.md", "data.csv", "plan.txt", "log.txt")
_NEW_DIRS = ("archive", "backup", "drafts", "temp", "shared")
KIND_CLASSES = {"math": "MathAPI", "fs": "GorillaFileSystem"}  # a task kind and the one simulator class it touches


def _entry(task_id: str, classes: list[str], turns: list[str], config: dict[str, Any], functions: tuple[str, ...]) -> dict[str, Any]:
    docs = [d for c in classes for d in func_docs(c) if d["name"] in functions]
    return {
        "id": task_id,
        "question": [[{"role": "user", "content": t}] for t in turns],
        "initial_config": config,
        "involved_classes": classes,
        "function": docs,
    }


def _call(name: str, **arguments: Any) -> str:
    return canonical_call(name, arguments)


def _math_task(rng: random.Random, task_id: str) -> tuple[dict[str, Any], list[list[str]]]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    op = rng.choice(MATH_FUNCTIONS)
    phrase = {"add": f"What is {a} plus {b}?", "subtract": f"What is {a} minus {b}?", "multiply": f"What is {a} times {b}?"}[op]
    first = {"add": a + b, "subtract": a - b, "multiply": a * b}[op]
    turns, gold = [phrase], [[_call(op, a=a, b=b)]]
    if rng.random() < 0.5:
        # Second turn carries the first result: the model must read the tool response.
        turns.append(f"Now multiply that result by {c}.")
        gold.append([_call("multiply", a=first, b=c)])
    return _entry(task_id, [KIND_CLASSES["math"]], turns, {}, MATH_FUNCTIONS), gold


def _fs_task(rng: random.Random, task_id: str) -> tuple[dict[str, Any], list[list[str]]]:
    folder = rng.choice(_FOLDERS)
    existing = rng.choice(_FILES)
    config = {
        "GorillaFileSystem": {
            "root": {"workspace": {"type": "directory", "contents": {folder: {"type": "directory", "contents": {existing: {"type": "file", "content": f"contents of {existing}"}}}}}}
        }
    }
    kind = rng.choice(("mkdir", "touch", "cat"))
    if kind == "mkdir":
        new = rng.choice(_NEW_DIRS)
        turns = [f"Go into the {folder} folder.", f"Create a directory called {new} there."]
        gold = [[_call("cd", folder=folder)], [_call("mkdir", dir_name=new)]]
    elif kind == "touch":
        new = rng.choice([f for f in _FILES if f != existing])
        turns = [f"In the {folder} folder, create an empty file named {new}."]
        gold = [[_call("cd", folder=folder), _call("touch", file_name=new)]]
    else:
        turns = [f"Go into the {folder} folder.", f"Show me what {existing} says."]
        gold = [[_call("cd", folder=folder)], [_call("cat", file_name=existing)]]
    return _entry(task_id, [KIND_CLASSES["fs"]], turns, config, FS_FUNCTIONS), gold


def generate_tasks(n: int, seed: int = 0, kinds: tuple[str, ...] = ("math", "fs")) -> list[Task]:
    """`n` tasks, reproducible from `seed`; `kinds` picks MathAPI and/or GorillaFileSystem."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    makers = {"math": _math_task, "fs": _fs_task}
    unknown = [k for k in kinds if k not in makers]
    if unknown or not kinds:
        raise ValueError(f"unknown task kinds {unknown or kinds}; expected a subset of {tuple(makers)}")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        entry, gold = makers[kind](rng, f"fc_learn_{kind}_{seed}_{i}")
        tasks.append(
            Task(
                id=entry["id"],
                question=entry["question"][0][0]["content"],
                answers=[],
                gold_turns=[gold_call_dicts(t, entry["involved_classes"]) for t in gold],
                kind=f"fc_learn_{kind}",
                meta={"category": f"fc_learn_{kind}", "entry": entry, "ground_truth": gold, "involved_classes": entry["involved_classes"]},
            )
        )
    return tasks


class LearnableEnv(BfclEnv):
    """BfclEnv under its own name: same prompts, executor, step limit and checker."""

    name = "fc_learn"
