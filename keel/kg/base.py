"""The contract every KG backend meets: paper B's four verbs plus names.

Backends (in-memory index, embedded SPARQL, remote SPARQL) answer these identically on the
same graph. Every method returns a sorted list of strings (ids for entities, relation names
for relations) and an empty list for any failed query: unknown entity, unknown relation, no
match. Arguments come from model output and are untrusted; a backend validates them and never
raises on a bad one.

Names are literal triples `(entity, type.object.name, "Name")`, kept apart from the graph: the
four verbs never return `type.object.name` or a literal.

Two members are optional (keel.kg.env reads them only when a store has them):
`relations() -> list[str]`, every relation of the graph (what `env.list_relations` lists and
the renamed-schema ablation, `env.rename_schema`, renames), and `resolve(name) -> str | None`,
an entity's id from its name (when `env.accept_names` or `env.readable_ids` lets the model
write names).
"""

from __future__ import annotations

from typing import Protocol

# Paper B's four verbs, the one definition (the env serves them; rewards and diagnostics read them).
TAIL_RELATIONS, HEAD_RELATIONS = "get_tail_relations", "get_head_relations"
TAIL_ENTITIES, HEAD_ENTITIES = "get_tail_entities", "get_head_entities"
RELATION_VERBS = (TAIL_RELATIONS, HEAD_RELATIONS)
ENTITY_VERBS = (TAIL_ENTITIES, HEAD_ENTITIES)
VERBS = RELATION_VERBS + ENTITY_VERBS


class KGStore(Protocol):
    def tail_relations(self, entity: str) -> list[str]:
        """Relations r with a triple (entity, r, ?)."""
        ...

    def head_relations(self, entity: str) -> list[str]:
        """Relations r with a triple (?, r, entity)."""
        ...

    def tail_entities(self, entity: str, relation: str) -> list[str]:
        """Entities t with a triple (entity, relation, t)."""
        ...

    def head_entities(self, entity: str, relation: str) -> list[str]:
        """Entities h with a triple (h, relation, entity)."""
        ...

    def has_entity(self, entity: str) -> bool:
        """True if the entity appears in any triple."""
        ...

    def name(self, entity: str) -> str | None:
        """The entity's name (Freebase `type.object.name`), None if it has none."""
        ...

    def has_relation(self, relation: str) -> bool:
        """True if any triple uses this relation."""
        ...
