"""Error decomposition of failed KG episodes by replaying the gold path (paper B's analysis).

Paper B sorted 1,958 retrieval-dependent errors and found 95.4% were retrieval-composition
failures (chaining entities across hops), not relation choice or answer extraction; the paper
does not publish its rules, so these are Keel's, precise enough to check by hand.

A *failed* episode has EM 0. It gets exactly one category, tested in this order:

1. `format` — no usable final answer (the episode never answered, or the answer is empty), or
   it made calls and none of them parsed.
2. `no_retrieval` — no call returned a non-empty observation: the answer came from memory (or
   the model never got a query right); not counted as retrieval-dependent.
3. `unverifiable` — the task has no gold triples, or a gold hop does not replay in the store
   (`tail_entities(h, r)` lacks t): the path cannot say where the episode went wrong.
4. `answer_extraction` — some non-empty observation contained a gold answer (an answer id, or
   a normalised answer/alias name as a whole returned entry) yet the final answer is wrong.
5. Otherwise the gold path is replayed hop by hop. Hop k = (h_k, r_k, t_k) is *completed* when
   some call was `get_tail_entities(h_k, r_k)` or `get_head_entities(t_k, r_k)` with a non-empty
   observation. A hop's *anchor* is the end already known when the walk reaches it: the topic
   entities are known at the start, and each hop makes its other end known (so a path that
   starts at a tail is walked backwards); when neither end is known, the anchor is h_k.
   At the first incomplete hop k:
   - `relation_selection` — the model queried the anchor entity (any verb) but never with r_k
     in an entity verb: it stood at the right entity and chose the wrong relation;
   - `composition` — the model never queried the anchor: it failed to carry the entity from
     hop k−1's output into the next call (for k = 0: it never used the topic entity), or it used
     r_k on another entity.
   If every hop is completed and still no observation showed the answer, the category is
   `answer_extraction` (the last hop's output reached the answer set under another name).

Calls are read as the env executed them (`Observation.resolved`: entity id and store relation,
whatever the spelling) where the observation records it; otherwise entities in call arguments
are matched as ids, or as names through `store.name` (for runs where the env shows names
instead of ids). Shares are over failed episodes; the retrieval-dependent
shares are over `relation_selection + composition + answer_extraction`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from keel.answers import exact_match, normalise
from keel.kg.base import ENTITY_VERBS, HEAD_ENTITIES, TAIL_ENTITIES, KGStore
from keel.rewards import answer_text, is_empty_observation, returned_entities
from keel.types import Step, Task, Trajectory

CATEGORIES = ("format", "no_retrieval", "unverifiable", "answer_extraction", "relation_selection", "composition")
RETRIEVAL_DEPENDENT = ("relation_selection", "composition", "answer_extraction")


def _call_entity_relation(step: Step) -> tuple[str, str]:
    """(entity, relation) of a KG call: as the env executed it (`Observation.resolved`, so that
    "Name (m.id)" is m.id and a renamed relation is the store's), else the `entity`/`relation`
    arguments, else the first and second string arguments."""
    resolved = step.observation.resolved
    if resolved is not None and len(resolved) == 3:
        return resolved[1], resolved[2]
    args = step.call.arguments
    strings = [v for v in args.values() if isinstance(v, str)]
    entity = args.get("entity") if isinstance(args.get("entity"), str) else (strings[0] if strings else "")
    relation = args.get("relation") if isinstance(args.get("relation"), str) else (strings[1] if len(strings) > 1 else "")
    return entity.strip(), relation.strip()


def _same_entity(arg: str, entity: str, store: KGStore) -> bool:
    if arg == entity:
        return True
    name = store.name(entity)
    return bool(name) and normalise(arg) == normalise(name)


def _answer_seen(task: Task, steps: list[Step], store: KGStore) -> bool:
    ids = set(task.answer_ids)
    names = {normalise(a) for a in list(task.answers) + list(task.aliases) if a}
    names |= {normalise(n) for i in ids if (n := store.name(i))}
    for s in steps:
        text = s.observation.result_text
        if is_empty_observation(text):
            continue
        if any(i in text for i in ids):
            return True
        if any(normalise(e) in names for e in returned_entities(text)):
            return True
    return False


def classify_failure(traj: Trajectory, task: Task, store: KGStore) -> dict[str, Any]:
    """{"task_id", "category", "hop", "detail"} for one failed episode (rules in the module
    docstring); `hop` is the first incomplete gold hop (None when not applicable)."""
    record: dict[str, Any] = {"task_id": traj.task_id, "category": "", "hop": None, "detail": ""}
    answer = answer_text(traj).strip()
    steps = traj.steps
    if not answer:
        return {**record, "category": "format", "detail": "no final answer"}
    if steps and all(s.call.error is not None for s in steps):
        return {**record, "category": "format", "detail": f"none of {len(steps)} calls parsed"}
    productive = [s for s in steps if s.call.error is None and not is_empty_observation(s.observation.result_text)]
    if not productive:
        return {**record, "category": "no_retrieval", "detail": f"{len(steps)} calls, none returned anything"}
    hops = list(task.gold_triples)
    if not hops:
        return {**record, "category": "unverifiable", "detail": "task has no gold triples"}
    for k, (h, r, t) in enumerate(hops):
        if t not in store.tail_entities(h, r):
            return {**record, "category": "unverifiable", "hop": k, "detail": f"gold hop {k} ({h}, {r}, {t}) is not in the store"}
    if _answer_seen(task, productive, store):
        return {**record, "category": "answer_extraction", "detail": "a tool output contained the gold answer"}
    calls = [(s.call.name, *_call_entity_relation(s)) for s in productive]
    all_calls = [(s.call.name, *_call_entity_relation(s)) for s in steps if s.call.error is None]
    known = set(task.topic_entities)
    for k, (h, r, t) in enumerate(hops):
        anchor = t if (t in known and h not in known) else h
        known.add(h if anchor == t else t)
        done = any(
            rel == r and ((verb == TAIL_ENTITIES and _same_entity(ent, h, store)) or (verb == HEAD_ENTITIES and _same_entity(ent, t, store)))
            for verb, ent, rel in calls
        )
        if done:
            continue
        touched = [(verb, rel) for verb, ent, rel in all_calls if _same_entity(ent, anchor, store)]
        if touched:
            used = sorted({rel for verb, rel in touched if verb in ENTITY_VERBS and rel})
            return {**record, "category": "relation_selection", "hop": k, "detail": f"queried the hop-{k} entity but with relations {used or 'none'} instead of {r}"}
        used_relation = any(rel == r for _verb, _ent, rel in all_calls)
        why = f"used {r} on another entity" if used_relation else ("never queried the topic entity" if k == 0 else f"never carried the hop-{k - 1} result into a call")
        return {**record, "category": "composition", "hop": k, "detail": why}
    return {**record, "category": "answer_extraction", "detail": "every gold hop was completed"}


def decompose_errors(trajs: list[Trajectory], tasks: dict[str, Task] | list[Task], store: KGStore) -> dict[str, Any]:
    """Categorise every failed (EM 0) episode; return counts, shares and per-episode records.

    Returns {"episodes", "failed", "counts": {category: n}, "shares": {category: n / failed},
    "retrieval_dependent": n, "retrieval_shares": {category: n / retrieval_dependent},
    "records": [classify_failure(...), ...]}.
    """
    by_id = tasks if isinstance(tasks, dict) else {t.id: t for t in tasks}
    records = []
    for traj in trajs:
        task = by_id.get(traj.task_id)
        if task is None:
            raise ValueError(f"decompose_errors: trajectory for task {traj.task_id!r} has no task among the {len(by_id)} given")
        if exact_match(traj.answer, list(task.answers) + list(task.aliases)) == 1.0:
            continue
        records.append(classify_failure(traj, task, store))
    counts = Counter(r["category"] for r in records)
    failed = len(records)
    dependent = sum(counts[c] for c in RETRIEVAL_DEPENDENT)
    return {
        "episodes": len(trajs),
        "failed": failed,
        "counts": {c: counts[c] for c in CATEGORIES},
        "shares": {c: counts[c] / failed if failed else 0.0 for c in CATEGORIES},
        "retrieval_dependent": dependent,
        "retrieval_shares": {c: counts[c] / dependent if dependent else 0.0 for c in RETRIEVAL_DEPENDENT},
        "records": records,
    }
