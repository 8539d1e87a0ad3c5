"""Latency of paper B's four KG verbs: in-memory index vs embedded SPARQL (vs a remote endpoint).

Builds a synthetic Freebase-shaped graph, asks each verb many times and prints p50/p99 per
verb and backend. Two sizes: `--triples` for the in-memory index alone (default 10M; the
target is p50 <= 20 µs) and `--sparql-triples` (default 1M) for a graph that every backend
holds, so their answers are also compared query by query.

    python bench/kg_verbs.py                                  # 10M in memory, 1M for SPARQL
    python bench/kg_verbs.py --triples 2000000                # smaller machine
    python bench/kg_verbs.py --write-nt /tmp/g.nt --triples 0 # then: oxigraph load -l db -f /tmp/g.nt;
    python bench/kg_verbs.py --endpoint http://127.0.0.1:7878/query --triples 0   # oxigraph serve -l db

The graph: n/8 entities `m.0<hex>`, 2,000 relations in 100 schema types of 20 (an entity uses
its own type's relations, as in Freebase), heads drawn ∝ u³ and tails ∝ u² (u uniform), so
a few hub entities hold thousands of edges, as /m/09c7w0 (USA) does in Freebase. Queries: 80%
taken from a random existing triple (hubs are therefore asked about in proportion to their
edges), 20% misses (unknown entity, or a relation the entity lacks).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
from typing import Callable, Iterator

import numpy as np

from keel.kg.sparql import OxigraphStore, RemoteSparqlStore, write_ntriples
from keel.kg.store import MemoryStore

VERBS = ("tail_relations", "head_relations", "tail_entities", "head_entities")
TYPES, RELATIONS_PER_TYPE = 100, 20


def relation_names() -> list[str]:
    return [f"domain{t // 10}.type{t}.property{k}" for t in range(TYPES) for k in range(RELATIONS_PER_TYPE)]


def synthetic_triples(n_triples: int, seed: int = 0, chunk: int = 1_000_000) -> Iterator[tuple[str, str, str]]:
    """n_triples (head, relation, tail) id triples (a few duplicates; stores keep them once)."""
    n_entities = max(n_triples // 8, 10)
    entities = [f"m.0{i:x}" for i in range(n_entities)]
    relations = relation_names()
    rng = np.random.default_rng(seed)
    for start in range(0, n_triples, chunk):
        size = min(chunk, n_triples - start)
        heads = (rng.random(size) ** 3 * n_entities).astype(np.int64)
        tails = (rng.random(size) ** 2 * n_entities).astype(np.int64)
        rels = (heads % TYPES) * RELATIONS_PER_TYPE + rng.integers(0, RELATIONS_PER_TYPE, size)
        for h, r, t in zip(heads.tolist(), rels.tolist(), tails.tolist()):
            yield entities[h], relations[r], entities[t]


def make_queries(triples: list[tuple[str, str, str]], n_per_verb: int, seed: int) -> dict[str, list[tuple]]:
    """For each verb, argument tuples: 80% from existing triples, 20% misses."""
    rng = np.random.default_rng(seed + 1)
    relations = relation_names()
    picks = rng.integers(0, len(triples), size=(len(VERBS), n_per_verb))
    misses = rng.random((len(VERBS), n_per_verb)) < 0.2
    queries: dict[str, list[tuple]] = {}
    for v, verb in enumerate(VERBS):
        args = []
        for i, (pick, miss) in enumerate(zip(picks[v].tolist(), misses[v].tolist())):
            head, relation, tail = triples[pick]
            entity = head if verb.startswith("tail") else tail
            if miss and (i % 2 == 0 or verb.endswith("relations")):
                entity = f"m.missing{i}"
            elif miss:
                relation = relations[(relations.index(relation) + 7) % len(relations)]  # likely absent
            args.append((entity,) if verb.endswith("relations") else (entity, relation))
        queries[verb] = args
    return queries


def time_calls(fn: Callable, args_list: list[tuple]) -> np.ndarray:
    """Wall time of each call in µs (one warm-up pass first; GC off while timing)."""
    for args in args_list[: min(200, len(args_list))]:
        fn(*args)
    times = np.empty(len(args_list))
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for i, args in enumerate(args_list):
            start = clock()
            fn(*args)
            times[i] = clock() - start
    finally:
        gc.enable()
    return times / 1000.0


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KiB on Linux


def report(label: str, store, queries: dict[str, list[tuple]]) -> None:
    for verb in VERBS:
        us = time_calls(getattr(store, verb), queries[verb])
        print(f"  {label:<10} {verb:<15} p50 {np.percentile(us, 50):9.1f} µs   p99 {np.percentile(us, 99):9.1f} µs   (n={len(us)})")


def compare(reference, other, queries: dict[str, list[tuple]]) -> int:
    return sum(getattr(reference, verb)(*args) != getattr(other, verb)(*args) for verb in VERBS for args in queries[verb])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--triples", type=int, default=10_000_000, help="graph size for the in-memory run (0: skip)")
    parser.add_argument("--sparql-triples", type=int, default=1_000_000, help="graph size shared by all backends (0: skip)")
    parser.add_argument("--queries", type=int, default=20_000, help="calls per verb (SPARQL backends: a fifth of it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--endpoint", help="also time this SPARQL endpoint (it must serve the --sparql-triples graph)")
    parser.add_argument("--write-nt", help="write the --sparql-triples graph as N-Triples here")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

    if args.sparql_triples:
        n = args.sparql_triples
        print(f"\n== shared graph: {n:,} triples ==")
        start = time.perf_counter()
        triples = list(synthetic_triples(n, args.seed))
        print(f"  generated in {time.perf_counter() - start:.1f} s")
        queries = make_queries(triples, args.queries, args.seed)
        few = {verb: q[: max(args.queries // 5, 1)] for verb, q in queries.items()}
        start = time.perf_counter()
        memory = MemoryStore.from_triples(triples)
        print(f"  memory   built in {time.perf_counter() - start:6.1f} s: {memory!r}")
        if args.write_nt:
            write_ntriples(args.write_nt, triples)
            print(f"  wrote {args.write_nt}")
        backends = {"memory": memory}
        if not args.endpoint or args.write_nt:
            start = time.perf_counter()
            backends["embedded"] = OxigraphStore.from_triples(triples)
            print(f"  embedded built in {time.perf_counter() - start:6.1f} s: {len(backends['embedded']):,} quads, RSS now {rss_gb():.1f} GB")
        if args.endpoint:
            backends["remote"] = RemoteSparqlStore(args.endpoint)
        for label, store in backends.items():
            if label != "memory":
                print(f"  {label}: {compare(memory, store, few)} answers differ from memory on {4 * len(few['tail_relations'])} queries")
        for label, store in backends.items():
            report(label, store, queries if label == "memory" else few)
        del triples, memory, backends
        gc.collect()

    if args.triples:
        n = args.triples
        print(f"\n== in-memory index: {n:,} triples ==")
        start = time.perf_counter()
        memory = MemoryStore.from_triples(synthetic_triples(n, args.seed))
        build_s = time.perf_counter() - start
        gc.collect()
        print(f"  built in {build_s:.1f} s: {memory!r}; process RSS {rss_gb():.1f} GB, peak {peak_gb():.1f} GB")
        # queries need triples to sample from: take them from the store itself
        sample = []
        for i, triple in enumerate(memory.iter_triples()):
            if i % max(n // 200_000, 1) == 0:
                sample.append(triple)
            if len(sample) >= 200_000:
                break
        report("memory", memory, make_queries(sample, args.queries, args.seed))


if __name__ == "__main__":
    main()
