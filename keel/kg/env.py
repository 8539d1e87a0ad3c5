"""Paper B's KG tool interface: four verbs over a triple store, with each interface channel a switch.

Paper B gives the model `get_tail_relations(e)`, `get_head_relations(e)`,
`get_tail_entities(e, r)`, `get_head_entities(e, r)` over Freebase with opaque ids and silent
`[]` failures, and names four channels that starve the RL signal: L_sig (silent failure),
L_lang (opaque ids), L_comp (ids carried across turns), L_prior (an unfamiliar schema). Here
each channel is one field of `KGEnvConfig` (keel.config; the `env:` section has the same
fields), so which one gates learning can be tested.

Departures: calls use Hermes `<tool_call>` JSON rather than paper B's `<search>` tags; result
lists are capped at `max_items` (paper B's endpoint returned everything); by default the system
prompt lists the graph's relations (`list_relations`), which paper B does not, so that a 135M
model can learn the task on CPU; `oracle_relations` also hints the first hop in the user
message, since "every step" in paper B includes the first.

What rewards read: each observation records the call as executed (`Observation.resolved`:
verb, entity id, relation, after resolving how the model spelled them), and, when the oracle
hint is appended to what the model sees, the tool's own output apart (`Observation.result`),
so that a hint never turns a failed call into a non-empty one.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from keel.config import KGEnvConfig
from keel.kg.base import ENTITY_VERBS, HEAD_ENTITIES, HEAD_RELATIONS, RELATION_VERBS, TAIL_ENTITIES, TAIL_RELATIONS, VERBS
from keel.types import Observation, Task, ToolCall

_MAX_ECHO = 60  # characters of a bad argument quoted back in an informative error line


_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string"} for k in args},
                "required": list(args),
            },
        },
    }
    for name, desc, args in (
        (TAIL_RELATIONS, "Relations r of triples (entity, r, ?)", ("entity",)),
        (HEAD_RELATIONS, "Relations r of triples (?, r, entity)", ("entity",)),
        (TAIL_ENTITIES, "Tails t of triples (entity, relation, t)", ("entity", "relation")),
        (HEAD_ENTITIES, "Heads h of triples (h, relation, entity)", ("entity", "relation")),
    )
]
_ARGUMENTS = {TAIL_RELATIONS: ("entity",), HEAD_RELATIONS: ("entity",), TAIL_ENTITIES: ("entity", "relation"), HEAD_ENTITIES: ("entity", "relation")}


def opaque_relation_name(relation: str, salt: str = "keel", attempt: int = 0) -> str:
    """A deterministic unfamiliar name for a relation, e.g. `r.k7x2.p91` (L_prior).

    Hash-derived, so the same relation gets the same name in every process and run;
    `attempt` > 0 resolves the (rare) collisions.
    """
    digest = hashlib.sha256(f"{salt}|{attempt}|{relation}".encode()).digest()
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    chars = [alphabet[b % 36] for b in digest[:7]]
    return "r." + "".join(chars[:4]) + "." + chars[4] + "".join(alphabet[26 + b % 10] for b in digest[5:7])


class KGEnv:
    """The KG tool environment (keel.types.Env) over any KGStore.

    Uses the store's optional `relations()` (prompt list, renaming) and `resolve(text)`
    (names as arguments) when it has them; the four verbs, `has_entity`, `has_relation` and
    `name` are all it needs otherwise.
    """

    name = "kg"

    def __init__(self, store, config: KGEnvConfig | None = None) -> None:
        self.store = store
        self.config = config or KGEnvConfig()
        if self.config.max_items < 1:
            raise ValueError(f"KGEnvConfig.max_items must be at least 1, got {self.config.max_items}")
        relations_fn = getattr(store, "relations", None)
        self._relations: list[str] = list(relations_fn()) if callable(relations_fn) else []
        self._to_shown: dict[str, str] = {}
        self._from_shown: dict[str, str] = {}
        if self.config.rename_schema:
            for r in self._relations:
                attempt = 0
                shown = opaque_relation_name(r, self.config.rename_salt)
                while shown in self._from_shown:
                    attempt += 1
                    shown = opaque_relation_name(r, self.config.rename_salt, attempt)
                self._to_shown[r] = shown
                self._from_shown[shown] = r

    # --- presentation ---------------------------------------------------------------------
    def tools(self, task: Task) -> list[dict[str, Any]]:
        return copy.deepcopy(_TOOLS)

    def system_prompt(self, task: Task) -> str:
        c = self.config
        # Every token here is re-encoded for every episode (a 135M model on CPU): about 75
        # tokens of instructions, about 110 more for a 14-relation list.
        if c.readable_ids:
            entities = "Entities are names; pass them exactly as shown."
        else:
            entities = 'Entities are ids like m.0abc12, shown as "Name (m.0abc12)"; pass ids exactly.'
        if c.accept_names and not c.readable_ids:
            entities += " Names are accepted too."
        lines = [
            "Answer the question using the knowledge-graph tools.",
            entities,
            "Several calls may go in one turn; each returns a JSON list.",
            "To finish, reply <answer>NAME</answer> with no tool call.",
        ]
        if c.plan:
            lines.append("Before your first call, plan the calls (verb and relation, in order) in <think></think>.")
        if c.list_relations and self._relations:
            lines.append("Relations: " + ", ".join(sorted(self.show_relation(r) for r in self._relations)))
        return "\n".join(lines)

    def user_message(self, task: Task) -> str:
        lines = [task.question]
        for entity, name in task.topic_entities.items():
            lines.append("Topic entity: " + self.display(entity, name or None))
        if self.config.oracle_relations:
            hint = _hint(self, task, 0)
            if hint:
                lines.append(hint)
        return "\n".join(lines)

    def display(self, entity: str, name: str | None = None) -> str:
        """How an entity is shown: "Name (m.id)", the id when it has no name, the name alone
        when `readable_ids`."""
        if name is None:
            name = self.store.name(entity)
        if not name or name == entity:
            return entity
        return name if self.config.readable_ids else f"{name} ({entity})"

    def show_relation(self, relation: str) -> str:
        return self._to_shown.get(relation, relation)

    def with_plan(self, task: Task) -> Task:
        """A copy of the task whose gold texts open with the plan `plan` asks for: the verb and
        relation of each gold turn's calls, in order, in `<think>…</think>` before the first call
        (e.g. `<think>get_tail_entities people.person.place_of_birth, get_tail_entities
        location.location.containedby</think>`, then the first call). Tasks without gold turns
        (or with gold texts of their own) are returned unchanged."""
        from keel.sft import gold_turn_texts

        if not task.gold_turns or task.meta.get("gold_texts"):
            return task
        steps = [f"{turn[0]['name']} {turn[0]['arguments']['relation']}" for turn in task.gold_turns
                 if turn and "relation" in turn[0].get("arguments", {})]
        texts = gold_turn_texts(task)
        out = Task.from_dict(copy.deepcopy(task.to_dict()))
        out.meta["gold_texts"] = [f"<think>{', '.join(steps)}</think>\n{texts[0]}", *texts[1:]]
        return out

    def translate_gold(self, task: Task) -> Task:
        """The task as this env shows it: relations renamed (rename_schema) and entity ids
        replaced by names (readable_ids) in gold_turns, gold_triples and the oracle plan, so
        SFT targets and the oracle speak the same interface the model sees. Returns a copy."""
        out = Task.from_dict(copy.deepcopy(task.to_dict()))
        c = self.config
        if not (c.rename_schema or c.readable_ids):
            return out
        ent = self._shown_argument
        rel = self.show_relation
        for turn in out.gold_turns:
            for call in turn:
                args = call.get("arguments", {})
                if isinstance(args.get("entity"), str):
                    args["entity"] = ent(args["entity"])
                if isinstance(args.get("relation"), str):
                    args["relation"] = rel(args["relation"])
        out.gold_triples = [(ent(h), rel(r), ent(t)) for h, r, t in out.gold_triples]
        plan = out.meta.get("plan")
        if plan:
            for path in plan.get("paths", []):
                path["start"] = [ent(e) for e in path.get("start", [])]
                for hop in path.get("hops", []):
                    hop["relation"] = rel(hop["relation"])
            filt = plan.get("filter")
            if filt:
                filt["relation"] = rel(filt["relation"])
                if filt.get("op") == "eq" and isinstance(filt.get("value"), str):
                    filt["value"] = ent(filt["value"])
        if c.readable_ids:
            out.meta["readable_ids"] = True
        return out

    def _shown_argument(self, entity: str) -> str:
        if not self.config.readable_ids:
            return entity
        return self.store.name(entity) or entity

    # --- episodes ---------------------------------------------------------------------------
    def start(self, task: Task) -> "KGEpisode":
        return KGEpisode(self, task)


class KGEpisode:
    """One episode: executes calls; never raises on anything a model writes."""

    def __init__(self, env: KGEnv, task: Task) -> None:
        self.env = env
        self.task = task
        self.progress = 0  # index of the gold turn the oracle hint points at

    def next_user_message(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    def execute(self, call: ToolCall) -> Observation:
        try:
            obs = self._execute(call)
        except Exception as exc:  # a store bug (e.g. a remote endpoint down) must not kill a run
            obs = self._fail("backend_error", f"the knowledge graph failed ({type(exc).__name__})")
        if self.env.config.oracle_relations:
            if obs.ok:
                self._advance(call)
            hint = _hint(self.env, self.task, self.progress)
            if hint:
                # The hint is for the model only: rewards read `result`, so that "[]\nHint: …"
                # still counts as an empty result and returned entities parse as without it.
                obs.result = obs.text
                obs.text += "\n" + hint
        return obs

    def _execute(self, call: ToolCall) -> Observation:
        if call.error:
            return self._fail(call.error, f"malformed tool call ({call.error})")
        verb = call.name
        if verb not in _ARGUMENTS:
            return self._fail("unknown_tool", f"unknown tool {_echo(verb)}; use one of {', '.join(VERBS)}")
        args = call.arguments if isinstance(call.arguments, dict) else None
        expected = _ARGUMENTS[verb]
        if args is None or set(args) != set(expected):
            got = ", ".join(sorted(_echo(k) for k in args)) if args else "none"
            return self._fail("bad_arguments", f"{verb} takes ({', '.join(expected)}), got ({got})")
        for key in expected:
            if not isinstance(args[key], str):
                return self._fail("bad_arguments", f"{verb}: {key} must be a string")
        entity = self._resolve_entity(args["entity"])
        if entity is None:
            return self._fail("unknown_entity", f"unknown entity {_echo(args['entity'])}")
        store = self.env.store
        # `executed` is the call in the store's terms: "m.x", " m.x" and "Name (m.x)" are one
        # call, and the R-selfV gate counts distinct calls by it, not by their spelling.
        if verb in RELATION_VERBS:
            executed = (verb, entity, "")
            found = store.tail_relations(entity) if verb == TAIL_RELATIONS else store.head_relations(entity)
            if not found:
                return self._fail("no_result", f"{verb}: no relations for {_echo(args['entity'])}", executed)
            shown = [self.env.show_relation(r) for r in found]
            if self.env.config.rename_schema:
                shown.sort()  # in the original order, the order would hint which opaque name is which
            return self._list(shown, shown, executed)
        relation = self._resolve_relation(args["relation"])
        if relation is None:
            return self._fail("unknown_relation", f"unknown relation {_echo(args['relation'])}")
        executed = (verb, entity, relation)
        found = store.tail_entities(entity, relation) if verb == TAIL_ENTITIES else store.head_entities(entity, relation)
        if not found:
            return self._fail("no_result", f"{verb}: nothing matches ({_echo(args['entity'])}, {_echo(args['relation'])})", executed)
        names = [store.name(e) for e in found]
        shown = [self.env.display(e, n) for e, n in zip(found, names)]
        items = [n or e for e, n in zip(found, names)]
        return self._list(shown, items, executed)

    def _list(self, shown: list[str], items: list[str], executed: tuple[str, str, str]) -> Observation:
        cap = self.env.config.max_items
        text = json.dumps(shown[:cap], ensure_ascii=False)
        if len(shown) > cap:
            text += f" ({len(shown) - cap} more not shown)"
        return Observation(text=text, ok=True, error=None, items=items[:cap], resolved=executed)

    def _fail(self, kind: str, message: str, executed: tuple[str, str, str] | None = None) -> Observation:
        text = f"ERROR: {message}" if self.env.config.informative_errors else "[]"
        return Observation(text=text, ok=False, error=kind, items=[], resolved=executed)

    def _resolve_entity(self, text: str) -> str | None:
        c = self.env.config
        return resolve_entity(self.env.store, text, accept_names=c.accept_names or c.readable_ids)

    def _resolve_relation(self, text: str) -> str | None:
        text = text.strip()
        if self.env.config.rename_schema:
            text = self.env._from_shown.get(text, "")
        return text if self.env.store.has_relation(text) else None

    def _advance(self, call: ToolCall) -> None:
        """Move the hint pointer past a gold turn when a successful call matches one of its
        (verb, relation) pairs. Parallel calls of the same gold turn match the previous turn
        and do not advance it again."""
        turns = self.task.gold_turns
        args = call.arguments if isinstance(call.arguments, dict) else {}
        key = (call.name, str(args.get("relation", "")).strip())
        if self.progress < len(turns) and key in _turn_keys(self.env, turns[self.progress]):
            self.progress += 1


def _turn_keys(env: KGEnv, turn: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(c.get("name", ""), env.show_relation(str(c.get("arguments", {}).get("relation", "")))) for c in turn}


def _hint(env: KGEnv, task: Task, progress: int) -> str:
    if progress >= len(task.gold_turns):
        return ""
    keys = sorted(_turn_keys(env, task.gold_turns[progress]))
    parts = [f"{verb} with {relation}" if relation else verb for verb, relation in keys]
    return "Hint: next use " + "; ".join(parts) + "."


def resolve_entity(store, text: str, accept_names: bool) -> str | None:
    """The entity id meant by `text`: an id as written; else "Name (m.id)" as shown in
    observations; else, with `accept_names`, a name the store resolves. None if none exists."""
    text = text.strip()
    if store.has_entity(text):
        return text
    parts = split_display(text)
    if parts and store.has_entity(parts[1]):
        return parts[1]
    resolve = getattr(store, "resolve", None)
    if accept_names and callable(resolve):
        found = resolve(text)
        if found is not None and store.has_entity(found):
            return found
    return None


def split_display(text: str) -> tuple[str, str] | None:
    """("Name", "m.id") from "Name (m.id)", None when the text is not of that shape.

    Linear time (a regex with a leading `.*` backtracks quadratically on a 4,096-character
    adversarial argument).
    """
    if not text.endswith(")"):
        return None
    i = text.rfind(" (")
    if i <= 0:
        return None
    inner = text[i + 2 : -1]
    if not inner or "(" in inner or ")" in inner:
        return None
    return text[:i], inner


def _echo(value: Any) -> str:
    """A bad argument quoted on one line, at most _MAX_ECHO characters."""
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else type(value).__name__
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= _MAX_ECHO else text[: _MAX_ECHO - 3] + "..."
