"""SPARQL backends (keel/kg/sparql.py): id encoding, injection safety, exact answers, and
equivalence of embedded SPARQL, remote SPARQL (`oxigraph serve`), the in-memory index and a
dict reference written here, on random graphs and random (also hostile) queries."""

from __future__ import annotations

import gzip
import http.server
import json
import logging
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pyoxigraph as ox
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runs import free_port
from keel.kg.sparql import (
    FREEBASE_NS,
    MAX_ID_CHARS,
    NAME_RELATION,
    OxigraphStore,
    RemoteSparqlStore,
    decode_local,
    encode_id,
    id_to_iri,
    iri_to_id,
    name_literal,
    verb_query,
    write_ntriples,
)

HOSTILE = [
    "> } ; DROP",
    '\\" . ?s ?p ?o',
    '" . ?s ?p ?o . "',
    "m.1> ?p ?o } #",
    "m.1\n",
    "line\nbreak\r\n",
    "<http://evil>",
    "http://rdf.freebase.com/ns/m.1",
    "# comment",
    "m.1 # } UNION { ?s ?p ?o",
    "x\\u003E } ; DROP ALL",
    "ünïcødé ✓ 東京",
    "\u202e\u0000\u0007",
    "a" * 10_000,
    "m." + "0" * (MAX_ID_CHARS - 2),
    ".",
    "..",
    "%41",
    "Ginger%20Rogers",
    "?x",
    "$x",
    "_:b0",
    "\ud800",
    "",
    " ",
]
NON_STRINGS = [None, 5, 1.5, ["m.1"], {"id": "m.1"}, b"m.1"]


class DictStore:
    """The KGStore contract, written as plainly as possible: the reference for equivalence."""

    def __init__(self, triples, names=None):
        self.triples = {t for t in triples if t[1] != NAME_RELATION}
        self.names = {t[0]: t[2] for t in triples if t[1] == NAME_RELATION} | dict(names or {})

    def tail_relations(self, e):
        return sorted({r for h, r, t in self.triples if h == e})

    def head_relations(self, e):
        return sorted({r for h, r, t in self.triples if t == e})

    def tail_entities(self, e, rel):
        return sorted({t for h, r, t in self.triples if h == e and r == rel})

    def head_entities(self, e, rel):
        return sorted({h for h, r, t in self.triples if t == e and r == rel})

    def has_entity(self, e):
        return any(e in (h, t) for h, r, t in self.triples)

    def has_relation(self, rel):
        return any(r == rel for h, r, t in self.triples)

    def name(self, e):
        return self.names.get(e) if isinstance(e, str) else None

    def resolve(self, text):
        if self.has_entity(text):
            return text
        ids = sorted(e for e, n in self.names.items() if n == text)
        return ids[0] if ids else None


def _memory_store(triples, names=None):
    """keel.kg.store.MemoryStore when it exists (written in parallel), else None."""
    try:
        from keel.kg.store import MemoryStore
    except ImportError:
        return None
    return MemoryStore.from_triples(triples, names)


# ---------------------------------------------------------------------------------------------
# Encoding


@pytest.mark.parametrize(
    "value, local",
    [
        ("m.0d3k14", "m.0d3k14"),  # Freebase mid: whitelisted, unchanged
        ("people.person.place_of_birth", "people.person.place_of_birth"),
        ("barack_obama", "barack_obama"),  # PathQuestion
        ("Ginger Rogers", "Ginger%20Rogers"),  # MetaQA: space = byte 0x20
        ("a/b#c", "a%2Fb%23c"),  # '/' = 0x2F, '#' = 0x23
        ("é", "%C3%A9"),  # UTF-8 of U+00E9 is C3 A9
        ("50%", "50%25"),  # '%' itself is encoded, so decoding is unambiguous
        ("~a-b", "~a-b"),
        (".", "%2E"),  # dot-only ids are encoded in full: no '.'/'..' path segments
        ("..", "%2E%2E"),
        ("> }", "%3E%20%7D"),
    ],
)
def test_encode_id_exact(value, local):
    assert encode_id(value) == local
    assert decode_local(local) == value
    assert id_to_iri(value) == FREEBASE_NS + local
    assert iri_to_id(FREEBASE_NS + local) == value


@pytest.mark.parametrize("value", ["", "\ud800", "a" * (MAX_ID_CHARS + 1)] + NON_STRINGS)
def test_encode_id_refuses(value):
    assert encode_id(value) is None
    assert id_to_iri(value) is None


@pytest.mark.parametrize(
    "iri",
    [
        FREEBASE_NS + "a%2fb",  # lowercase hex: not what encode_id writes
        FREEBASE_NS + "a b",  # raw space
        FREEBASE_NS + "%41",  # encode_id("A") is "A", not "%41"
        FREEBASE_NS + "%FF",  # not UTF-8
        FREEBASE_NS + ".",
        FREEBASE_NS,
        "http://example.org/m.1",  # other namespace
        "http://rdf.freebase.com/ns",
    ],
)
def test_iri_to_id_refuses_foreign_or_non_canonical(iri):
    assert iri_to_id(iri) is None


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_encoding_round_trips_and_stays_in_the_safe_alphabet(text):
    local = encode_id(text)
    if local is None:  # only text that is not valid Unicode (lone surrogates)
        with pytest.raises(UnicodeEncodeError):
            text.encode("utf-8")
        return
    assert decode_local(local) == text
    assert set(local) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.~%-")


def test_name_literal():
    assert name_literal("Ginger Rogers") == '"Ginger Rogers"'
    assert name_literal('The "Boss"') == '"The \\"Boss\\""'
    for bad in ["", "a\\u0022b", "a\\b", "a\nb", "a\rb", "a\x00b", "\ud800", "a" * (MAX_ID_CHARS + 1), None, 3]:
        assert name_literal(bad) is None


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=30))
def test_any_writable_name_resolves_to_its_entity(text):
    """Whatever `name_literal` accepts, the literal means exactly `text` to the SPARQL parser."""
    store = OxigraphStore.from_triples([("m.1", "a.b", "m.2")], {"m.2": text, "m.3": text + "x"})
    if text in ("m.1", "m.2"):
        expected = text  # an id resolves to itself
    else:
        expected = None if name_literal(text) is None else "m.2"
    assert store.resolve(text) == expected and store.name("m.2") == text


# ---------------------------------------------------------------------------------------------
# Queries: model text never changes a query's shape


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30))
def test_argument_only_fills_the_iri_slot(entity, relation):
    local_e, local_r = encode_id(entity), encode_id(relation)
    if local_e is None or local_r is None:
        return
    for verb in ("tail_relations", "head_relations", "tail_entities", "head_entities", "has_entity", "has_relation", "name"):
        template = verb_query(verb, FREEBASE_NS, "SLOTE", "SLOTR")
        query = verb_query(verb, FREEBASE_NS, local_e, local_r)
        assert query == template.replace("SLOTE", local_e).replace("SLOTR", local_r)
        ox.Store().query(query)  # parses


def test_verb_query_exact_text():
    ns = FREEBASE_NS
    assert verb_query("tail_entities", ns, "m.1", "a.b") == (
        f"SELECT DISTINCT ?x WHERE {{ <{ns}m.1> <{ns}a.b> ?x . "
        f'FILTER(isIRI(?x) && STRSTARTS(STR(?x), "{ns}")) }}'
    )
    assert verb_query("head_entities", ns, "m.1", "a.b", limit=7).endswith("LIMIT 7")
    with pytest.raises(ValueError, match="refusing to splice"):
        verb_query("tail_relations", ns, "m.1> ?p ?o")
    with pytest.raises(ValueError, match="refusing to splice"):
        verb_query("resolve", ns, '"a" } ?s ?p ?o')
    with pytest.raises(ValueError, match="unknown verb"):
        verb_query("drop_all", ns, "m.1")


# ---------------------------------------------------------------------------------------------
# Exact answers on a hand-made graph

SMALL = [
    ("m.01", "film.film.directed_by", "m.02"),
    ("m.01", "film.film.starring", "m.03"),
    ("m.01", "film.film.starring", "Ginger Rogers"),
    ("m.04", "film.film.starring", "m.03"),
    ("m.02", "people.person.spouse", "m.03"),
    ("m.01", NAME_RELATION, "Top Hat"),  # a name given as a triple
]
SMALL_NAMES = {"m.02": "Mark Sandrich", "Ginger Rogers": "Ginger Rogers", "m.99": "Nobody"}


def _check_small(store):
    assert store.tail_relations("m.01") == ["film.film.directed_by", "film.film.starring"]
    assert store.head_relations("m.03") == ["film.film.starring", "people.person.spouse"]
    assert store.tail_entities("m.01", "film.film.starring") == ["Ginger Rogers", "m.03"]  # 'G' (71) < 'm' (109)
    assert store.head_entities("m.03", "film.film.starring") == ["m.01", "m.04"]
    assert store.tail_entities("m.01", NAME_RELATION) == []
    assert store.tail_relations("m.03") == []
    assert store.tail_relations("m.404") == []
    assert store.tail_entities("m.01", "film.film.sequel") == []
    assert store.has_entity("Ginger Rogers") and store.has_entity("m.04")
    assert not store.has_entity("m.99")  # a name alone is not an entity
    assert store.has_relation("people.person.spouse")
    assert not store.has_relation(NAME_RELATION) and not store.has_relation("m.01")
    assert store.name("m.01") == "Top Hat" and store.name("m.02") == "Mark Sandrich"
    assert store.name("m.99") == "Nobody" and store.name("m.03") is None
    assert store.resolve("Top Hat") == "m.01" and store.resolve("m.03") == "m.03"
    assert store.resolve("Nobody") == "m.99" and store.resolve("Fred Astaire") is None


def test_exact_answers_every_backend(tmp_path):
    _check_small(DictStore(SMALL, SMALL_NAMES))
    _check_small(OxigraphStore.from_triples(SMALL, SMALL_NAMES))
    write_ntriples(tmp_path / "small.nt", SMALL, SMALL_NAMES)
    _check_small(OxigraphStore.from_files(tmp_path / "small.nt"))
    _check_small(OxigraphStore.from_triples(SMALL, SMALL_NAMES, path=tmp_path / "disk"))
    memory = _memory_store(SMALL, SMALL_NAMES)
    if memory is not None:
        _check_small(memory)


def test_limit_caps_answers():
    store = OxigraphStore.from_triples([("m.1", "a.b", f"m.{i}") for i in range(10)], limit=3)
    assert len(store.tail_entities("m.1", "a.b")) == 3


def test_iter_triples_round_trip():
    store = OxigraphStore.from_triples(SMALL, SMALL_NAMES)
    names = [(e, NAME_RELATION, n) for e, n in ({"m.01": "Top Hat"} | SMALL_NAMES).items()]
    assert sorted(store.iter_triples()) == sorted([t for t in SMALL if t[1] != NAME_RELATION] + names)
    assert len(store) == 5 + 4  # 5 graph triples + 4 name literals (m.01, m.02, Ginger Rogers, m.99)
    _check_small(OxigraphStore.from_triples(store.iter_triples()))
    memory = _memory_store(SMALL, SMALL_NAMES)
    if memory is not None:  # each store rebuilds the other
        _check_small(_memory_store(list(store.iter_triples())))
        assert sorted(OxigraphStore.from_triples(memory.iter_triples()).iter_triples()) == sorted(store.iter_triples())


# ---------------------------------------------------------------------------------------------
# Freebase files: prefixes, language tags, literals and foreign IRIs stay out of the verbs

FREEBASE_TTL = """@prefix ns: <http://rdf.freebase.com/ns/> .
@prefix rdf: <http://www.w3.org/1999/02/22-rdf-syntax-ns#> .
@prefix xsd: <http://www.w3.org/2001/XMLSchema#> .
ns:m.0d3k14 ns:people.person.place_of_birth ns:m.02_286 .
ns:m.0d3k14 ns:people.person.date_of_birth "1917-05-29"^^xsd:date .
ns:m.0d3k14 rdf:type ns:people.person .
ns:m.0d3k14 ns:common.topic.official_website <http://jfk.example.org/> .
ns:m.0d3k14 ns:type.object.name "JFK"@fr .
ns:m.0abc ns:type.object.name ns:m.0d3k14 .
ns:m.0d3k14 ns:type.object.name "John F. Kennedy"@en .
ns:m.02_286 ns:type.object.name "New York City" .
ns:m.02_286 ns:location.location.contains ns:m.0abc .
"""


def test_freebase_turtle_conventions(tmp_path):
    ttl = tmp_path / "fb.ttl"
    ttl.write_text(FREEBASE_TTL)
    with gzip.open(tmp_path / "fb.ttl.gz", "wt") as out:
        out.write(FREEBASE_TTL)
    for store in (OxigraphStore.from_files(ttl), OxigraphStore.from_files(tmp_path / "fb.ttl.gz")):
        # date literal, rdf:type (foreign relation) and the website (foreign IRI) are not graph triples
        assert store.tail_relations("m.0d3k14") == ["people.person.place_of_birth"]
        assert store.tail_entities("m.0d3k14", "people.person.date_of_birth") == []
        assert not store.has_relation("people.person.date_of_birth")
        assert store.head_entities("m.02_286", "people.person.place_of_birth") == ["m.0d3k14"]
        assert store.head_relations("m.0abc") == ["location.location.contains"]
        # a malformed name whose object is an IRI is still a name, never a graph edge
        assert store.tail_relations("m.0abc") == [] and store.head_relations("m.0d3k14") == []
        assert store.name("m.0d3k14") == "John F. Kennedy"  # @en kept, @fr ignored ("JFK" sorts first)
        assert store.name("m.02_286") == "New York City"  # untagged kept
        assert store.resolve("John F. Kennedy") == "m.0d3k14" and store.resolve("JFK") is None
        assert sorted(store.iter_triples()) == [
            ("m.02_286", "location.location.contains", "m.0abc"),
            ("m.02_286", NAME_RELATION, "New York City"),
            ("m.0d3k14", "people.person.place_of_birth", "m.02_286"),
            ("m.0d3k14", NAME_RELATION, "John F. Kennedy"),  # not "JFK"@fr
        ]


def test_bad_files_and_bad_triples(tmp_path):
    bad = tmp_path / "bad.nt"
    bad.write_text("<http://rdf.freebase.com/ns/m.1> <http://rdf.freebase.com/ns/a.b> .\n")
    with pytest.raises(ValueError, match=r"bad\.nt: invalid N-Triples data") as info:
        OxigraphStore.from_files(bad)
    assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"missing\.nt: no such RDF file"):
        OxigraphStore.from_files(tmp_path / "missing.nt")
    with pytest.raises(ValueError, match=r"unknown RDF format '\.csv'"):
        OxigraphStore.from_files(tmp_path / "graph.csv")
    with pytest.raises(ValueError, match="triple 1: relation '' is not a usable id"):
        OxigraphStore.from_triples([("m.1", "a.b", "m.2"), ("m.1", "", "m.2")])
    with pytest.raises(ValueError, match=r"triple 0: expected \(head, relation, tail\)"):
        OxigraphStore.from_triples([("m.1", "a.b")])
    with pytest.raises(ValueError, match="triple 0: tail 7 is not a usable id"):
        OxigraphStore.from_triples([("m.1", "a.b", 7)])
    with pytest.raises(ValueError, match="names: entry 'm.1' -> 3"):
        OxigraphStore.from_triples([("m.1", "a.b", "m.2")], {"m.1": 3})
    with pytest.raises(ValueError, match="namespace"):
        OxigraphStore(namespace='http://x/"> }')
    with pytest.raises(ValueError, match="limit"):
        OxigraphStore(limit=0)
    store = OxigraphStore.from_triples([("m.1", "a.b", "m.2")])
    with pytest.raises(ValueError):
        store.add_triples([("m.3", "a.b", "m.4"), ("m.3", "a.b", None)])
    assert not store.has_entity("m.3")  # a bad batch adds nothing


@pytest.mark.parametrize("name, data, message", [
    ("latin1.nt", '<http://rdf.freebase.com/ns/m.1> <http://rdf.freebase.com/ns/type.object.name> "Café" .\n'.encode("latin-1"),
     "invalid N-Triples data"),
    ("binary.ttl", bytes(range(256)) * 16, "invalid Turtle data"),
    ("truncated.nt.gz", gzip.compress(b"<http://rdf.freebase.com/ns/m.1> <http://rdf.freebase.com/ns/a.b> <http://rdf.freebase.com/ns/m.2> .\n" * 100)[:60],
     "invalid N-Triples data"),
    ("graph.csv", b"m.1,a.b,m.2\n", "unknown RDF format '.csv'"),
], ids=["latin-1", "binary", "truncated gzip", "unknown format"])
def test_a_bad_rdf_file_is_a_user_error_naming_it(tmp_path, name, data, message):
    from keel.errors import UserError, user_message

    (tmp_path / name).write_bytes(data)
    with pytest.raises(UserError, match=message) as info:
        OxigraphStore.from_files(tmp_path / name)
    assert user_message(info.value) == str(info.value) and str(info.value).startswith(f"{tmp_path / name}: ")


# ---------------------------------------------------------------------------------------------
# Hostile arguments


def _hostile_graph():
    """A canary graph, plus triples whose ids *are* hostile strings (they must still work)."""
    triples = [("m.1", "a.b", "m.2"), ("m.2", "a.c", "m.1")]
    real_hostile = [h for h in HOSTILE if encode_id(h) is not None]
    for i, h in enumerate(real_hostile[:8]):
        triples.append((h, "x.y", f"m.h{i}"))
        triples.append((f"m.h{i}", h if FREEBASE_NS not in h else "x.z", h))
    return triples


@pytest.mark.parametrize("arg", HOSTILE + NON_STRINGS)
def test_hostile_arguments_never_raise_or_leak(arg):
    triples = _hostile_graph()
    store, ref = OxigraphStore.from_triples(triples), DictStore(triples)
    for verb in ("tail_relations", "head_relations", "has_entity", "name", "resolve"):
        assert getattr(store, verb)(arg) == getattr(ref, verb)(arg), verb
    for other in ("m.1", "a.b", "x.y"):
        assert store.tail_entities(arg, other) == ref.tail_entities(arg, other)
        assert store.tail_entities(other, arg) == ref.tail_entities(other, arg)
        assert store.head_entities(arg, other) == ref.head_entities(arg, other)
        assert store.head_entities(other, arg) == ref.head_entities(other, arg)
    assert store.has_relation(arg) == ref.has_relation(arg)
    # an injected `?s ?p ?o` would return the canary triple's relations; it must not
    if not ref.has_entity(arg):
        assert store.tail_relations(arg) == [] and store.head_relations(arg) == []


# ---------------------------------------------------------------------------------------------
# Equivalence on random graphs and random queries


def random_graph(rng: random.Random, n_entities=120, n_relations=12, n_triples=600):
    """Ids in every style Keel meets: Freebase mids, PathQuestion/MetaQA names, odd text."""
    styles = [
        lambda i: f"m.0{i:x}",
        lambda i: f"person_{i}",
        lambda i: f"Film Title {i}",
        lambda i: f"Zoë & Co. ({i})",
        lambda i: f'a"b\\c {i} #',
        lambda i: f"{i}/{i}?x=1",
    ]
    entities = [styles[i % len(styles)](i) for i in range(n_entities)] + [".", "..", "%41"]
    relations = [f"domain.type.rel_{j}" for j in range(n_relations - 2)] + ["directed by", "has_tags"]
    triples = {(rng.choice(entities), rng.choice(relations), rng.choice(entities)) for _ in range(n_triples)}
    # a hub: many relations and tails, as Freebase's popular entities
    triples |= {(entities[0], rng.choice(relations), rng.choice(entities)) for _ in range(60)}
    names = {e: f"Name {k % 50}" for k, e in enumerate(rng.sample(entities, 80))}  # names repeat
    names[entities[1]] = 'Quote "Me"'
    return sorted(triples), names, entities, relations


def random_queries(rng: random.Random, entities, relations, n=400):
    pool_e = entities + ["m.missing", "Film Title 99999"] + HOSTILE
    pool_r = relations + ["domain.type.missing", NAME_RELATION] + HOSTILE
    names = [f"Name {k}" for k in range(55)] + ['Quote "Me"']
    queries = []
    for _ in range(n):
        e, r = rng.choice(pool_e), rng.choice(pool_r)
        queries += [
            ("tail_relations", (e,)),
            ("head_relations", (e,)),
            ("tail_entities", (e, r)),
            ("head_entities", (e, r)),
            ("has_entity", (e,)),
            ("has_relation", (r,)),
            ("name", (e,)),
            ("resolve", (rng.choice(names + [e]),)),
        ]
    # queries that do hit: an existing (entity, relation) pair
    return queries


def _answers(store, queries):
    return [getattr(store, verb)(*args) for verb, args in queries]


def _hit_queries(triples):
    return [("tail_entities", (h, r)) for h, r, _ in triples] + [("head_entities", (t, r)) for _, r, t in triples]


def test_random_equivalence_embedded_vs_reference(tmp_path):
    rng = random.Random(0)
    for seed in range(3):
        triples, names, entities, relations = random_graph(random.Random(seed))
        queries = random_queries(rng, entities, relations) + _hit_queries(triples)
        expected = _answers(DictStore(triples, names), queries)
        assert sum(bool(a) for a in expected) > len(queries) // 3  # the test exercises real answers
        write_ntriples(tmp_path / f"g{seed}.nt", triples, names)
        backends = {
            "embedded": OxigraphStore.from_triples(triples, names),
            "embedded-file": OxigraphStore.from_files(tmp_path / f"g{seed}.nt"),
        }
        memory = _memory_store(triples, names)
        if memory is not None:
            backends["memory"] = memory
            backends["embedded-from-memory"] = OxigraphStore.from_triples(memory.iter_triples())
        for label, store in backends.items():
            got = _answers(store, queries)
            diffs = [(q, e, g) for q, e, g in zip(queries, expected, got) if e != g]
            assert not diffs, f"{label}: {len(diffs)} differences, first {diffs[0]}"


# ---------------------------------------------------------------------------------------------
# Remote: oxigraph serve on loopback, and misbehaving fake endpoints


def _oxigraph_binary() -> str | None:
    found = shutil.which("oxigraph")
    local = Path(sys.executable).parent / "oxigraph"
    return found or (str(local) if local.exists() else None)


@pytest.fixture
def oxigraph_server(tmp_path):
    """(endpoint, triples, names, entities, relations) of a served random graph."""
    binary = _oxigraph_binary()
    if binary is None:
        pytest.skip("the `oxigraph` CLI (PyPI package oxigraph==0.5.13) is not installed")
    triples, names, entities, relations = random_graph(random.Random(7))
    graph = tmp_path / "graph.nt"
    write_ntriples(graph, triples, names)
    location = tmp_path / "db"
    subprocess.run([binary, "load", "--location", str(location), "--file", str(graph)], check=True, capture_output=True, timeout=60)
    port = free_port()
    server = subprocess.Popen(
        [binary, "serve-read-only", "--location", str(location), "--bind", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    endpoint = f"http://127.0.0.1:{port}/query"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                RemoteSparqlStore(endpoint, timeout_s=2)
                break
            except ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"oxigraph serve did not start: {server.stderr.read().decode()[:300]}")
                time.sleep(0.05)
        yield endpoint, triples, names, entities, relations
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_remote_embedded_memory_identical(oxigraph_server):
    endpoint, triples, names, entities, relations = oxigraph_server
    queries = random_queries(random.Random(1), entities, relations, n=150) + _hit_queries(triples)[:300]
    expected = _answers(DictStore(triples, names), queries)
    backends = {
        "remote-post": RemoteSparqlStore(endpoint),
        "remote-get": RemoteSparqlStore(endpoint, method="GET"),
        "embedded": OxigraphStore.from_triples(triples, names),
    }
    memory = _memory_store(triples, names)
    if memory is not None:
        backends["memory"] = memory
    for label, store in backends.items():
        got = _answers(store, queries)
        diffs = [(q, e, g) for q, e, g in zip(queries, expected, got) if e != g]
        assert not diffs, f"{label}: {len(diffs)} differences, first {diffs[0]}"
    assert backends["remote-post"].failures == 0 and backends["remote-get"].failures == 0


def test_remote_dead_endpoint_answers_empty_and_logs(oxigraph_server, caplog):
    endpoint, *_ = oxigraph_server
    store = RemoteSparqlStore(endpoint, timeout_s=2)
    store.endpoint = f"http://127.0.0.1:{free_port()}/query"  # the server "goes away"
    with caplog.at_level(logging.ERROR, logger="keel.kg.sparql"):
        assert store.tail_relations("m.01") == []
        assert store.tail_entities("m.01", "a.b") == []
        assert store.has_entity("m.01") is False
        assert store.name("m.01") is None
        assert store.resolve("Name 3") is None
    assert store.failures == 6  # resolve asks has_entity first, then the name query
    assert "connection failed" in caplog.text


def test_remote_constructor_errors():
    port = free_port()  # nothing listens there
    with pytest.raises(ConnectionError, match=rf"SPARQL endpoint http://127.0.0.1:{port}/sparql is not usable: connection failed") as info:
        RemoteSparqlStore(f"http://127.0.0.1:{port}/sparql", timeout_s=2)
    assert "\n" not in str(info.value)
    for bad in ["file:///etc/passwd", "ftp://x/sparql", "localhost:8890", "", None]:
        with pytest.raises(ValueError, match="must be an http"):
            RemoteSparqlStore(bad, check=False)
    with pytest.raises(ValueError, match="method"):
        RemoteSparqlStore("http://localhost/sparql", method="PUT", check=False)
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteSparqlStore("http://localhost/sparql", timeout_s=0, check=False)
    with pytest.raises(ValueError, match="graph"):
        RemoteSparqlStore("http://localhost/sparql", graph="<x>", check=False)


class _FakeEndpoint(http.server.BaseHTTPRequestHandler):
    """Answers by path: /virtuoso (old-style JSON), /500, /html, /slow, /nobindings."""

    seen: list = []

    def _answer(self, query: str, graph: str | None):
        type(self).seen.append((self.command, self.path.split("?")[0], query, graph))
        path = self.path.split("?")[0]
        if path == "/500":
            return 500, b"Virtuoso 37000 Error SP030: SPARQL compiler\nline 1"
        if path == "/html":
            return 200, b"<html>not json</html>"
        if path == "/slow":
            time.sleep(1.0)
        if path == "/nobindings" and not query.startswith("ASK"):
            return 200, b'{"head": {}, "results": {}}'
        if query.startswith("ASK"):
            return 200, json.dumps({"head": {}, "boolean": True}).encode()
        bindings = [
            {"x": {"type": "uri", "value": FREEBASE_NS + "m.0b"}},
            {"x": {"type": "uri", "value": FREEBASE_NS + "Ginger%20Rogers"}},
            {"x": {"type": "uri", "value": "http://example.org/other"}},  # foreign: dropped
            {"x": {"type": "typed-literal", "value": FREEBASE_NS + "m.0lit", "datatype": "xsd:string"}},  # literal: dropped
            {"x": {"type": "uri", "value": FREEBASE_NS + "m.0b"}},  # duplicate: once
            {"y": {"type": "uri", "value": FREEBASE_NS + "m.0c"}},  # wrong variable: dropped
        ]
        if "type.object.name" in query and "?x <" not in query:
            bindings = [{"x": {"type": "literal", "value": "JFK", "xml:lang": "en"}}]
        return 200, json.dumps({"head": {"vars": ["x"]}, "results": {"bindings": bindings}}).encode()

    def _reply(self, query, graph):
        code, body = self._answer(query, graph)
        self.send_response(code)
        self.send_header("Content-Type", "application/sparql-results+json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out first (/slow)
            pass

    def do_GET(self):
        params = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        self._reply(params["query"][0], params.get("default-graph-uri", [None])[0])

    def do_POST(self):
        params = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        assert self.headers["Accept"] == "application/sparql-results+json"
        self._reply(params["query"][0], params.get("default-graph-uri", [None])[0])

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeEndpoint.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_parses_virtuoso_json_and_sends_graph(fake_endpoint):
    store = RemoteSparqlStore(fake_endpoint + "/virtuoso", graph="http://freebase.com", method="GET")
    assert store.tail_entities("m.0a", "film.film.starring") == ["Ginger Rogers", "m.0b"]
    assert store.name("m.0a") == "JFK"
    method, path, query, graph = _FakeEndpoint.seen[-2]
    assert (method, path, graph) == ("GET", "/virtuoso", "http://freebase.com")
    assert f"<{FREEBASE_NS}m.0a> <{FREEBASE_NS}film.film.starring> ?x" in query


def test_remote_failures_become_empty(fake_endpoint, caplog):
    with pytest.raises(ConnectionError, match=r"is not usable: HTTP 500 .*Virtuoso 37000 Error SP030: SPARQL compiler line 1$"):
        RemoteSparqlStore(fake_endpoint + "/500")
    with pytest.raises(ConnectionError, match="response is not SPARQL JSON"):
        RemoteSparqlStore(fake_endpoint + "/html")
    for path, reason in [("/500", "HTTP 500"), ("/html", "not SPARQL JSON"), ("/slow", "timed out"), ("/nobindings", "no results.bindings")]:
        store = RemoteSparqlStore(fake_endpoint + path, timeout_s=0.3, check=False)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="keel.kg.sparql"):
            start = time.monotonic()
            assert store.tail_entities("m.0a", "film.film.starring") == []
            assert store.tail_relations("m.0a") == []
            assert time.monotonic() - start < 2.0  # the 0.3 s timeout holds (the fake sleeps 1 s)
        assert store.failures == 2 and reason in caplog.text, (path, caplog.text)
