"""MemoryStore: exact answers on a hand-built graph, equivalence with a brute-force scan, bad
inputs, deterministic iteration, lookup speed."""

import random
import statistics
import time

import pytest

from keel.kg.store import NAME_RELATION, MemoryStore

# A film with a director, a CVT performance node, and names kept apart.
TRIPLES = [
    ("m.film", "film.film.directed_by", "m.bob"),
    ("m.film", "film.film.starring", "m.perf1"),
    ("m.film", "film.film.starring", "m.perf0"),
    ("m.perf0", "film.performance.actor", "m.alice"),
    ("m.perf1", "film.performance.actor", "m.bob"),
    ("m.bob", "people.person.place_of_birth", "m.paris"),
    ("m.film", "film.film.directed_by", "m.bob"),  # duplicate: counts once
    ("m.film", NAME_RELATION, "Heat"),
    ("m.bob", NAME_RELATION, "Bob"),
    ("m.alice", NAME_RELATION, "Alice"),
    ("m.alice2", NAME_RELATION, "Alice"),  # a second "Alice" that is in no graph triple
]


@pytest.fixture(scope="module")
def store():
    return MemoryStore.from_triples(TRIPLES, names={"m.paris": "Paris"})


def test_four_verbs_exact(store):
    assert store.tail_relations("m.film") == ["film.film.directed_by", "film.film.starring"]
    assert store.head_relations("m.bob") == ["film.film.directed_by", "film.performance.actor"]
    assert store.tail_entities("m.film", "film.film.starring") == ["m.perf0", "m.perf1"]  # sorted, not insertion order
    assert store.head_entities("m.bob", "film.performance.actor") == ["m.perf1"]
    assert store.head_entities("m.paris", "people.person.place_of_birth") == ["m.bob"]


def test_names_are_not_graph_triples(store):
    # 11 input lines - 4 name lines - 1 duplicate = 6 graph triples
    assert store.num_triples == 6
    assert NAME_RELATION not in store.tail_relations("m.film")
    assert store.tail_entities("m.film", NAME_RELATION) == []
    assert not store.has_relation(NAME_RELATION)
    assert store.name("m.film") == "Heat"
    assert store.name("m.paris") == "Paris"  # from the names argument
    assert store.name("m.perf0") is None  # a CVT has no name
    assert not store.has_entity("m.alice2")  # named but in no triple


def test_resolve(store):
    assert store.resolve("m.bob") == "m.bob"
    assert store.resolve("Bob") == "m.bob"
    assert store.resolve("Alice") == "m.alice"  # two entities named Alice: the smallest id wins
    assert store.resolve("Nobody") is None
    assert store.resolve(None) is None


@pytest.mark.parametrize("bad", [None, 3, 2.5, ["m.film"], {"a": 1}, b"m.film", "", "M.FILM", "m.film "])
def test_bad_arguments_give_empty(store, bad):
    assert store.tail_relations(bad) == []
    assert store.head_relations(bad) == []
    assert store.tail_entities(bad, "film.film.directed_by") == []
    assert store.head_entities(bad, "film.film.directed_by") == []
    assert store.tail_entities("m.film", bad) == []
    assert store.head_entities("m.bob", bad) == []
    assert store.has_entity(bad) is False
    assert store.has_relation(bad) is False
    assert store.name(bad) is None


def test_returned_lists_are_copies(store):
    tails = store.tail_entities("m.film", "film.film.starring")
    tails.append("m.injected")
    assert store.tail_entities("m.film", "film.film.starring") == ["m.perf0", "m.perf1"]


def test_entities_relations_and_iteration(store):
    assert store.entities() == ["m.alice", "m.bob", "m.film", "m.paris", "m.perf0", "m.perf1"]
    assert store.relations() == ["film.film.directed_by", "film.film.starring", "film.performance.actor", "people.person.place_of_birth"]
    rows = list(store.iter_triples())
    graph = [r for r in rows if r[1] != NAME_RELATION]
    assert graph == sorted(set(t for t in TRIPLES if t[1] != NAME_RELATION))
    assert rows[len(graph):] == [
        ("m.alice", NAME_RELATION, "Alice"),
        ("m.alice2", NAME_RELATION, "Alice"),
        ("m.bob", NAME_RELATION, "Bob"),
        ("m.film", NAME_RELATION, "Heat"),
        ("m.paris", NAME_RELATION, "Paris"),
    ]
    again = MemoryStore.from_triples(rows)
    assert list(again.iter_triples()) == rows


def _brute(triples):
    """The four verbs by scanning every triple: the reference the index must equal."""
    graph = set(triples)
    return {
        "tail_relations": lambda e: sorted({r for h, r, t in graph if h == e}),
        "head_relations": lambda e: sorted({r for h, r, t in graph if t == e}),
        "tail_entities": lambda e, rel: sorted({t for h, r, t in graph if h == e and r == rel}),
        "head_entities": lambda e, rel: sorted({h for h, r, t in graph if t == e and r == rel}),
    }


def test_equals_brute_force_scan():
    rng = random.Random(7)
    entities = [f"m.0{k:02d}" for k in range(25)]
    relations = ["a.b.c", "a.b.d", "x.y.z", "x.y.w"]
    triples = [(rng.choice(entities), rng.choice(relations), rng.choice(entities)) for _ in range(300)]
    store = MemoryStore.from_triples(triples)
    brute = _brute(triples)
    for e in entities + ["m.missing"]:
        assert store.tail_relations(e) == brute["tail_relations"](e)
        assert store.head_relations(e) == brute["head_relations"](e)
        for rel in relations + ["no.such.rel"]:
            assert store.tail_entities(e, rel) == brute["tail_entities"](e, rel)
            assert store.head_entities(e, rel) == brute["head_entities"](e, rel)
    assert store.num_triples == len(set(triples))


def test_lookup_speed_p50_under_20_microseconds():
    # 300k random triples over 60k entities (building 1M takes ~10 s on one core, and lookups
    # are dict hits whose cost does not grow with the graph). Measured: ~1 µs per verb.
    rng = random.Random(0)
    entities = [f"m.0{k:05x}" for k in range(60_000)]
    relations = [f"r.rel.{k}" for k in range(40)]
    store = MemoryStore.from_triples(
        (rng.choice(entities), rng.choice(relations), rng.choice(entities)) for _ in range(300_000)
    )
    queries = [(rng.choice(entities), rng.choice(relations)) for _ in range(5000)]
    for verb in (store.tail_entities, store.head_entities):
        times = []
        for e, r in queries:
            t0 = time.perf_counter_ns()
            verb(e, r)
            times.append(time.perf_counter_ns() - t0)
        assert statistics.median(times) / 1000 <= 20.0
    for verb in (store.tail_relations, store.head_relations):
        times = []
        for e, _ in queries:
            t0 = time.perf_counter_ns()
            verb(e)
            times.append(time.perf_counter_ns() - t0)
        assert statistics.median(times) / 1000 <= 20.0
