"""Readers for real KG data: triple files into a MemoryStore, question files into Keel Tasks.

Paper B uses CWQ over Freebase; no Freebase subgraph is available offline, so besides CWQ
(ToG's test file and the original record format, read without a graph) Keel reads two small
real KGQA sets whose graphs ship with them: PathQuestion (Freebase-derived, 2/3-hop gold
paths) and MetaQA (movie KG, 1/2/3-hop relation paths). Their entity ids are the names.
Each task carries the oracle plan (`meta["plan"]`, see `keel.kg.oracle`) that walks its gold path.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from keel.errors import UserError
from keel.kg.base import HEAD_ENTITIES, TAIL_ENTITIES
from keel.kg.oracle import run_plan
from keel.kg.store import MemoryStore
from keel.rundir import parse_jsonl
from keel.types import Task

FORMATS = ("keel", "cwq", "pathquestion", "metaqa")
_MID_RE = re.compile(r"ns:([mg]\.[0-9a-z_]+)")
_RELATION_RE = re.compile(r"ns:([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+){2,})")


def _open_text(path: Path) -> io.TextIOBase:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":  # gzip, whatever the suffix says
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _readable(path: Path, what: str):
    """Turn a decoding failure while reading `path` into one UserError naming the file: Keel
    reads UTF-8 text (plain or gzipped); a binary or Latin-1 file is said to be one."""

    class Guard:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            if isinstance(exc, UnicodeDecodeError):
                raise UserError(f"{what} {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start} of a "
                                "read block); Keel reads UTF-8 files, plain or gzipped") from None
            if isinstance(exc, (EOFError, gzip.BadGzipFile, OSError)) and not isinstance(exc, FileNotFoundError):
                raise UserError(f"{what} {path} cannot be read ({type(exc).__name__}: {exc})") from None
            return False

    return Guard()


# --- triples ---------------------------------------------------------------------------------
def read_triples(path: str | Path) -> Iterator[tuple[str, str, str]]:
    """(head, relation, tail) from a `head\\trelation\\ttail` or `head|relation|tail` file,
    optionally gzipped. The separator is read off the first non-blank line (a tab if it has
    one, else "|"); blank lines are skipped; any other line without exactly three non-empty
    fields raises ValueError naming the file and line number."""
    path = Path(path)
    separator: str | None = None
    with _readable(path, "triples file"), _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if "\x00" in line:
                raise UserError(f"{path}:{lineno}: a NUL byte: this is a binary file, not triples text")
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if separator is None:
                separator = "\t" if "\t" in line else "|" if "|" in line else None
                if separator is None:
                    raise UserError(f"{path}:{lineno}: neither a tab nor '|' separates the fields")
            fields = line.split(separator)
            if len(fields) != 3 or not all(fields):
                shown = "tab" if separator == "\t" else "'|'"
                raise UserError(f"{path}:{lineno}: expected 3 non-empty {shown}-separated fields, got {len(fields)}: {line[:80]!r}")
            yield fields[0], fields[1], fields[2]


def load_store(path: str | Path | Iterable[str | Path]) -> MemoryStore:
    """A MemoryStore from one triple file or several (their union); `type.object.name`
    triples become names."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise UserError("load_store: no triple file given")

    def all_triples() -> Iterator[tuple[str, str, str]]:
        for p in paths:
            yield from read_triples(p)

    return MemoryStore.from_triples(all_triples())


# --- tasks -----------------------------------------------------------------------------------
def load_tasks(path: str | Path, fmt: str = "auto", store=None, consistent_only: bool = True) -> list[Task]:
    """Tasks from a question file.

    fmt: "keel" (Task.to_dict JSON lines), "cwq" (the original records with `answers` objects,
    or ToG's with an `answer` string and `topic_entity` {mid: name}; a JSON list or JSON lines),
    "pathquestion" (`question\\tanswer(a1/a2/)\\ttopic#r1#e1#r2#e2...`), "metaqa" (JSON lines,
    optionally gzipped), or "auto" (read off the file). `store`, when given, is used by
    MetaQA to compute gold turns and triples (they need the intermediate entities) and by
    PathQuestion to orient hops stored head-to-tail the other way. `consistent_only` keeps the
    MetaQA questions whose gold answers equal the KG's (`gold_consistent`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_tasks: no such file: {path}")
    with _readable(path, "questions file"):
        return _load_tasks(path, fmt, store, consistent_only)


def _load_tasks(path: Path, fmt: str, store, consistent_only: bool) -> list[Task]:
    if fmt == "auto":
        fmt = _detect_format(path)
    if fmt == "keel":
        return [Task.from_dict(r) for _, r in _json_records(path)]
    if fmt == "cwq":
        return [_cwq_task(r, path, k) for k, r in _json_records(path)]
    if fmt == "pathquestion":
        return _pathquestion_tasks(path, store)
    if fmt == "metaqa":
        return _metaqa_tasks(path, store, consistent_only)
    raise UserError(f"load_tasks: unknown format {fmt!r} for {path}; use one of {', '.join(FORMATS)} or auto")


def _detect_format(path: Path) -> str:
    with _open_text(path) as f:
        first = ""
        for line in f:  # the whole first non-blank line, however long (a 1 MB question is still one record)
            if line.strip():
                first = line.rstrip("\r\n")
                break
    if "\x00" in first:
        raise UserError(f"load_tasks: {path} holds NUL bytes: a binary file, not questions")
    stripped = first.lstrip()
    if stripped.startswith("["):
        return "cwq"  # ToG's and the original CWQ files are JSON lists; Keel and MetaQA are JSON lines
    if stripped.startswith("{"):
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            raise UserError(f"load_tasks: cannot tell the format of {path}: its first line is not one JSON record; pass fmt=") from None
        if "relation_path" in record:
            return "metaqa"
        if "ID" in record:
            return "cwq"
        if "id" in record and "answers" in record:
            return "keel"
    elif len(first.split("\t")) == 3 and "#" in first.split("\t")[2]:
        return "pathquestion"
    raise UserError(f"load_tasks: cannot tell the format of {path}; pass fmt= one of {', '.join(FORMATS)}")


def _json_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number or list index, record) from a JSON list or a JSON-lines file (the
    lines read by keel.rundir.parse_jsonl, as every input file of records is)."""
    with _open_text(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        for k, record in enumerate(records):
            if not isinstance(record, dict):
                raise UserError(f"{path}: item {k} is not a JSON object")
            yield k, record
        return
    for lineno, record in parse_jsonl(text.split("\n"), path):  # "\n" only: str.splitlines would also cut at a raw U+2028
        if not isinstance(record, dict):
            raise UserError(f"{path}:{lineno}: not a JSON object")
        yield lineno, record


def _cwq_task(record: dict[str, Any], path: Path, where: int) -> Task:
    try:
        question = record["question"]
        sparql = record.get("sparql", "")
        if isinstance(record.get("answers"), list):  # the original CWQ release
            answers = [a["answer"] for a in record["answers"] if a.get("answer")]
            aliases = [al for a in record["answers"] for al in a.get("aliases", []) or []]
            answer_ids = [a["answer_id"] for a in record["answers"] if a.get("answer_id")]
        else:  # ToG's version: one answer name, no id
            answers = [record["answer"]] if record.get("answer") else []
            aliases, answer_ids = [], []
        topic = record.get("topic_entity")
        if isinstance(topic, dict):
            topics = {str(k): str(v) for k, v in topic.items()}
        else:  # no names in the original records: the mids the SPARQL mentions
            topics = {mid: "" for mid in dict.fromkeys(_MID_RE.findall(sparql))}
        return Task(
            id=str(record["ID"]),
            question=question,
            answers=answers,
            aliases=aliases,
            answer_ids=answer_ids,
            topic_entities=topics,
            kind=record.get("compositionality_type", ""),
            meta={
                "sparql": sparql,
                "relations": list(dict.fromkeys(_RELATION_RE.findall(sparql))),
                "machine_question": record.get("machine_question", ""),
            },
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{path}: CWQ record {where} lacks a field or has a wrong type ({type(exc).__name__}: {exc})") from None


def _parse_pathquestion_answers(field: str) -> list[str]:
    """"united_kingdom(united_kingdom/)" → ["united_kingdom"]; the primary answer first.

    The primary may itself hold parentheses ("x_(band)(x_(band)/)"), so the split point is
    the "(" after which the set (between it and the final ")") names the primary.
    """
    if field.endswith(")"):
        for i, ch in enumerate(field):
            if ch == "(" and i > 0:
                primary, inner = field[:i], field[i + 1 : -1]
                members = [m for m in inner.split("/") if m]
                if primary in members:
                    return [primary] + [m for m in members if m != primary]
        i = field.rfind("(")
        if i > 0:
            primary = field[:i]
            return [primary] + [m for m in field[i + 1 : -1].split("/") if m and m != primary]
    return [field]


def _pathquestion_tasks(path: Path, store) -> list[Task]:
    tasks = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 3:
                raise UserError(f"{path}:{lineno}: expected question, answers and path separated by tabs, got {len(fields)} fields")
            question, answer_field, path_field = fields[0].strip(), fields[1].strip(), fields[2].strip()
            chain = path_field.split("#")
            if "<end>" in chain:
                chain = chain[: chain.index("<end>")]
            if len(chain) < 3 or len(chain) % 2 == 0:
                raise UserError(f"{path}:{lineno}: gold path {path_field[:80]!r} is not topic#relation#entity[#relation#entity...]")
            answers = _parse_pathquestion_answers(answer_field)
            topic = chain[0]
            hops, turns, triples = [], [], []
            for k in range(1, len(chain), 2):
                source, relation, target = chain[k - 1], chain[k], chain[k + 1]
                verb = TAIL_ENTITIES
                if store is not None and target not in store.tail_entities(source, relation) and source in store.tail_entities(target, relation):
                    verb = HEAD_ENTITIES  # the KB stores this hop target→source
                hops.append({"verb": verb, "relation": relation, "exclude_start": False})
                turns.append([{"name": verb, "arguments": {"entity": source, "relation": relation}}])
                triples.append((source, relation, target) if verb == TAIL_ENTITIES else (target, relation, source))
            tasks.append(
                Task(
                    id=f"{path.stem}-{lineno}",
                    question=question,
                    answers=answers,
                    answer_ids=list(answers),
                    topic_entities={topic: topic},
                    gold_turns=turns,
                    gold_triples=triples,
                    kind=f"{len(hops)}-hop",
                    meta={"plan": {"paths": [{"start": [topic], "hops": hops}], "filter": None}, "entity_ids_are_names": True},
                )
            )
    return tasks


def _metaqa_tasks(path: Path, store, consistent_only: bool) -> list[Task]:
    tasks = []
    for lineno, r in _json_records(path):
        try:
            if consistent_only and not r.get("gold_consistent", False):
                continue
            topic = r["topic_entity"]
            # MetaQA's gold answers exclude the topic at every hop ("films that share a director
            # with [X]" never answer X); the flag `gold_consistent` was computed that way.
            hops = [
                {"verb": TAIL_ENTITIES if direction == "fwd" else HEAD_ENTITIES, "relation": relation, "exclude_start": True}
                for direction, relation in r["relation_path"]
            ]
            plan = {"paths": [{"start": [topic], "hops": hops}], "filter": None}
            turns, triples = [], []
            if store is not None:
                turns, _, triples = run_plan(plan, store)
            tasks.append(
                Task(
                    id=str(r["id"]),
                    question=r["question"],
                    answers=list(r["answers"]),
                    answer_ids=list(r["answers"]),
                    topic_entities={topic: topic},
                    gold_turns=turns,
                    gold_triples=triples,
                    kind=f"{len(hops)}-hop",
                    meta={"plan": plan, "entity_ids_are_names": True, "qtype": r.get("qtype", ""), "gold_consistent": r.get("gold_consistent")},
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}:{lineno}: MetaQA record lacks a field or has a wrong type ({type(exc).__name__}: {exc})") from None
    return tasks
