"""Scripted policies for the KG env: an oracle that walks the gold relation path, and a null policy.

Paper B's oracle ablation injects the gold relation into the prompt; this oracle goes further
and *acts*: it issues the four verbs along the gold path, reading the entity ids it needs from
the previous tool responses exactly as a model would (it never reads the store), and answers
from the last observation. Its EM is the ceiling the interface allows (max_items caps, gold
labels that disagree with the KG), so a low oracle EM flags a data or env bug, not a model one.

The plan lives in `Task.meta["plan"]` (filled by `keel.kg.synth` and `keel.kg.loaders`):

    {"paths": [{"start": [id, ...],
                "hops": [{"verb": "get_tail_entities" | "get_head_entities",
                          "relation": r, "exclude_start": bool}, ...]}, ...],
     "filter": None | {"verb": v, "relation": r, "op": "lt" | "gt" | "eq" | "min" | "max",
                       "value": str | None}}

Each path is walked one hop per assistant turn (all paths advance in the same turn, one call
per frontier entity: parallel calls); the result sets of the paths are intersected
(conjunction); the optional filter looks up one attribute of every candidate in one more turn
and keeps those whose value compares true (comparative), equals `value` (conjunction by
check), or is the smallest/largest (superlative). `exclude_start` drops the path's start
entities from that hop's result (Freebase CVTs such as `people.marriage` lead back to the
topic; MetaQA's "films that share a director with X" must not answer X).
"""

from __future__ import annotations

import json
import re
from typing import Any, Generator

from keel.answers import normalise
from keel.chat import render_assistant_calls
from keel.kg.base import TAIL_ENTITIES
from keel.kg.env import split_display

_DECODER = json.JSONDecoder()

# An item of a walk: (argument to pass to the next call, name to answer with).
Item = tuple[str, str]
Call = dict[str, Any]


def walk_plan(plan: dict[str, Any]) -> Generator[list[Call], list[list[Item]], list[Item]]:
    """The plan as a coroutine: yields the calls of one assistant turn, receives one result
    list per call (in call order), returns the final answer items.

    The same coroutine drives `run_plan` (results from a store) and `oracle_policy` (results
    parsed from tool messages), so the gold turns and the oracle's calls cannot disagree.
    """
    paths = plan.get("paths") or []
    frontiers: list[list[Item]] = [[(e, e) for e in p.get("start", [])] for p in paths]
    max_hops = max((len(p.get("hops", [])) for p in paths), default=0)
    for h in range(max_hops):
        calls: list[Call] = []
        owners: list[int] = []
        for i, path in enumerate(paths):
            hops = path.get("hops", [])
            if h < len(hops):
                hop = hops[h]
                for arg, _ in frontiers[i]:
                    calls.append({"name": hop["verb"], "arguments": {"entity": arg, "relation": hop["relation"]}})
                    owners.append(i)
        if not calls:  # every frontier is empty: nothing more to ask
            break
        results = yield calls
        advanced = {i for i, path in enumerate(paths) if h < len(path.get("hops", []))}
        new: dict[int, list[Item]] = {i: [] for i in advanced}
        seen: dict[int, set[str]] = {i: set() for i in advanced}
        for owner, result in zip(owners, results):
            hop = paths[owner]["hops"][h]
            excluded = set(paths[owner].get("start", [])) if hop.get("exclude_start") else set()
            for item in result:
                if item[0] not in seen[owner] and item[0] not in excluded:
                    seen[owner].add(item[0])
                    new[owner].append(item)
        for i in advanced:
            frontiers[i] = new[i]
    candidates = frontiers[0] if frontiers else []
    for other in frontiers[1:]:
        keep = {arg for arg, _ in other}
        candidates = [c for c in candidates if c[0] in keep]
    filt = plan.get("filter")
    if filt and candidates:
        calls = [{"name": filt["verb"], "arguments": {"entity": c[0], "relation": filt["relation"]}} for c in candidates]
        results = yield calls
        candidates = _apply_filter(filt, candidates, results)
    return candidates


def _apply_filter(filt: dict[str, Any], candidates: list[Item], results: list[list[Item]]) -> list[Item]:
    op = filt["op"]
    if op == "eq":
        return [c for c, res in zip(candidates, results) if any(arg == filt["value"] for arg, _ in res)]
    scored = [(v, c) for c, res in zip(candidates, results) if (v := _number(res)) is not None]
    if op == "lt":
        return [c for v, c in scored if v < float(filt["value"])]
    if op == "gt":
        return [c for v, c in scored if v > float(filt["value"])]
    if op in ("min", "max") and scored:
        best = min(v for v, _ in scored) if op == "min" else max(v for v, _ in scored)
        return [c for v, c in scored if v == best][:1]  # ties: the first in observation order
    return []


def _number(result: list[Item]) -> float | None:
    """The first value of an attribute lookup read as a number ("1967", "1967-05-02" → 1967)."""
    for arg, name in result:
        m = re.match(r"-?\d+(\.\d+)?", name) or re.match(r"-?\d+(\.\d+)?", arg)
        if m:
            return float(m.group(0))
    return None


def run_plan(plan: dict[str, Any], store) -> tuple[list[list[Call]], list[str], list[tuple[str, str, str]]]:
    """Execute a plan against a store: (gold turns, answer ids, gold triples).

    Gold triples are the traversed edges that lie on a path from a start entity to a final
    answer (dead branches pruned), stored-orientation (head, relation, tail), plus the filter
    edges of the answers.
    """
    turns: list[list[Call]] = []
    edges: list[list[tuple[str, str, str, str]]] = []  # per turn: (source, verb, relation, result)
    walker = walk_plan(plan)
    try:
        calls = next(walker)
        while True:
            turns.append(calls)
            results, turn_edges = [], []
            for call in calls:
                verb, entity, relation = call["name"], call["arguments"]["entity"], call["arguments"]["relation"]
                ids = store.tail_entities(entity, relation) if verb == TAIL_ENTITIES else store.head_entities(entity, relation)
                results.append([(i, store.name(i) or i) for i in ids])
                turn_edges.extend((entity, verb, relation, i) for i in ids)
            edges.append(turn_edges)
            calls = walker.send(results)
    except StopIteration as stop:
        answers = [arg for arg, _ in stop.value]
    alive = set(answers)
    kept: list[tuple[str, str, str]] = []
    has_filter = bool(plan.get("filter")) and len(turns) > max((len(p.get("hops", [])) for p in plan.get("paths", [])), default=0)
    for t in range(len(turns) - 1, -1, -1):
        if has_filter and t == len(turns) - 1:
            kept.extend(_oriented(e) for e in edges[t] if e[0] in alive)
            continue
        sources = set()
        for e in edges[t]:
            if e[3] in alive:
                kept.append(_oriented(e))
                sources.add(e[0])
        alive |= sources
    kept = sorted(set(kept))
    return turns, answers, kept


def _oriented(edge: tuple[str, str, str, str]) -> tuple[str, str, str]:
    source, verb, relation, result = edge
    return (source, relation, result) if verb == TAIL_ENTITIES else (result, relation, source)


def parse_observation(text: str, ids_are_names: bool = False) -> list[Item]:
    """The items of a tool response as (argument, name) pairs.

    Reads the JSON list at the start of the text (ignoring a trailing "(N more not shown)" or
    hint line); anything else (an ERROR line, garbage) reads as no items. "Name (m.id)" splits
    into ("m.id", "Name"); a bare string is both. When ids are names (PathQuestion, MetaQA,
    readable ids) nothing is split: "Alice (1990)" is one MetaQA film, not a name and an id.
    """
    try:
        value, _ = _DECODER.raw_decode(text.strip())
    except (json.JSONDecodeError, ValueError):
        return []
    if not isinstance(value, list):
        return []
    items: list[Item] = []
    for entry in value:
        if not isinstance(entry, str):
            continue
        parts = None if ids_are_names else split_display(entry)
        items.append((parts[1], parts[0]) if parts else (entry, entry))
    return items


def oracle_policy(task, messages: list[dict[str, Any]]) -> str:
    """Text policy for `keel.episode.run_text_episode`: the next assistant turn of the gold walk.

    Stateless: it replays its own plan over the tool responses already in `messages` (one
    `tool` message per call, in call order, after each assistant turn), then emits the next
    turn's `<tool_call>` blocks, or `<answer>NAME</answer>` when the walk is over (the first
    final item, in observation order, whose name is not empty once normalised). A task
    without `meta["plan"]` gets `<answer>unknown</answer>`.
    """
    plan = (task.meta or {}).get("plan")
    if not plan:
        return "<answer>unknown</answer>"
    ids_are_names = bool(task.meta.get("entity_ids_are_names") or task.meta.get("readable_ids"))
    turns: list[list[str]] = []
    for m in messages:
        if m.get("role") == "assistant":
            turns.append([])
        elif m.get("role") == "tool" and turns:
            turns[-1].append(m.get("content", ""))
    walker = walk_plan(plan)
    try:
        calls = next(walker)
        for responses in turns:
            results = [parse_observation(responses[k], ids_are_names) if k < len(responses) else [] for k in range(len(calls))]
            calls = walker.send(results)
    except StopIteration as stop:
        # The first answer that survives normalisation: MetaQA has a film titled "$", which
        # normalises to "" and can never score EM (7 of 12,440 2-hop test questions list it first).
        final = [name for _, name in stop.value]
        readable = [name for name in final if normalise(name)]
        return f"<answer>{(readable or final or ['unknown'])[0]}</answer>"
    return render_assistant_calls(calls)


def null_policy(task, messages: list[dict[str, Any]]) -> str:
    """A policy that never calls a tool: the floor every tool-use result is measured against."""
    return "<answer>unknown</answer>"
