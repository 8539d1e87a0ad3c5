"""The oracle walks gold paths through the env as a model would; its EM is the interface's ceiling.

Measured numbers (default max_items=30 unless said), asserted exactly below:
  synthetic seed 0 dev 100/100, test 200/200 (also under every interface switch);
  PQ-2H 1908/1908, PQ-3H 5198/5198, PQL-2H 1588/1594 (1594/1594 uncapped: 6 questions need
  an intermediate hop with more than 30 entities); the gold path reproduces the exact gold
  answer set in 1908/1908, 5198/5198, 1594/1594;
  MetaQA gold_consistent, asserted on the first 2000 of 1-hop and 2-hop dev (2000/2000 each);
  on all of them: 1-hop dev 9454/9454, test 9377/9377; 2-hop dev 12327/12327, test
  12440/12440; 3-hop dev 9408/9412, test 9417/9420 (all 3-hop uncapped).
  Null policy: 0 everywhere.
"""

import json
from pathlib import Path

import pytest

from keel.answers import exact_match
from keel.chat import parse_tool_calls
from keel.episode import run_text_episode
from keel.kg import synth
from keel.kg.env import KGEnv, KGEnvConfig
from keel.kg.loaders import load_store, load_tasks
from keel.kg.oracle import null_policy, oracle_policy, parse_observation, run_plan, walk_plan
from keel.kg.store import MemoryStore
from keel.types import Task

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kg"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


def em_count(env, tasks, policy=oracle_policy, translate=False):
    total = 0
    for task in tasks:
        shown = env.translate_gold(task) if translate else task
        episode = run_text_episode(env, shown, policy, max_turns=6)
        total += exact_match(episode.answer, task.answers + task.aliases)
    return int(total)


@pytest.fixture(scope="module")
def synthetic():
    return synth.generate_splits(seed=0)


def test_synthetic_oracle_is_perfect_and_null_is_zero(synthetic):
    kg, splits = synthetic
    env = KGEnv(kg.store)
    assert em_count(env, splits["dev"]) == 100
    assert em_count(env, splits["test"]) == 200
    assert em_count(env, splits["test"], null_policy) == 0


@pytest.mark.parametrize("config", [
    KGEnvConfig(readable_ids=True),
    KGEnvConfig(rename_schema=True),
    KGEnvConfig(accept_names=True, informative_errors=True, oracle_relations=True, list_relations=False),
    KGEnvConfig(readable_ids=True, rename_schema=True, oracle_relations=True),
])
def test_synthetic_oracle_under_every_switch(synthetic, config):
    kg, splits = synthetic
    assert em_count(KGEnv(kg.store, config), splits["dev"], translate=True) == 100


def test_oracle_calls_are_the_gold_turns(synthetic):
    kg, splits = synthetic
    env = KGEnv(kg.store)
    for task in splits["dev"]:
        episode = run_text_episode(env, task, oracle_policy, max_turns=6)
        called = [[{"name": c.name, "arguments": c.arguments} for c in parse_tool_calls(text)] for text in episode.turn_texts[:-1]]
        assert called == task.gold_turns, task.question
        assert episode.finished and len(episode.steps) == sum(len(t) for t in task.gold_turns)
        assert all(step.observation.ok for step in episode.steps)


def test_oracle_reads_observations_not_the_store():
    # The same task on a graph where Bob was born in Rome instead: the oracle follows what it sees.
    triples = [("m.film", "film.film.directed_by", "m.bob"), ("m.bob", "people.person.place_of_birth", "m.x")]
    plan = {"paths": [{"start": ["m.film"], "hops": [
        {"verb": "get_tail_entities", "relation": "film.film.directed_by"},
        {"verb": "get_tail_entities", "relation": "people.person.place_of_birth"}]}], "filter": None}
    task = Task(id="t", question="q", answers=["Paris"], topic_entities={"m.film": "Heat"}, meta={"plan": plan})
    paris = run_text_episode(KGEnv(MemoryStore.from_triples(triples, {"m.x": "Paris"})), task, oracle_policy, 6)
    rome = run_text_episode(KGEnv(MemoryStore.from_triples(triples, {"m.x": "Rome"})), task, oracle_policy, 6)
    assert (paris.answer, rome.answer) == ("Paris", "Rome")
    assert paris.messages[-1] == {"role": "assistant", "content": "<answer>Paris</answer>"}


def _drive(plan, results_per_turn):
    """Run walk_plan with scripted results; returns (calls per turn, final items)."""
    walker = walk_plan(plan)
    turns = []
    try:
        calls = next(walker)
        for results in results_per_turn:
            turns.append(calls)
            calls = walker.send(results)
        raise AssertionError("the walk did not end")
    except StopIteration as stop:
        return turns, stop.value


@pytest.mark.parametrize("op, value, expected", [
    ("lt", "1960", ["f1"]),  # 1950 < 1960; 1970 and 1965 are not
    ("gt", "1960", ["f2", "f3"]),
    ("min", None, ["f1"]),
    ("max", None, ["f2"]),
])
def test_filters_by_hand(op, value, expected):
    plan = {"paths": [{"start": ["p"], "hops": [{"verb": "get_head_entities", "relation": "directed_by"}]}],
            "filter": {"verb": "get_tail_entities", "relation": "year", "op": op, "value": value}}
    films = [("f1", "F1"), ("f2", "F2"), ("f3", "F3")]
    turns, final = _drive(plan, [[films], [[("1950", "1950")], [("1970", "1970")], [("1965", "1965")]]])
    assert len(turns) == 2 and len(turns[1]) == 3
    assert [arg for arg, _ in final] == expected


def test_conjunction_intersects_and_exclude_start_drops_the_topic():
    plan = {"paths": [
        {"start": ["a"], "hops": [{"verb": "get_tail_entities", "relation": "r"}, {"verb": "get_tail_entities", "relation": "s", "exclude_start": True}]},
        {"start": ["b"], "hops": [{"verb": "get_tail_entities", "relation": "t"}]},
    ], "filter": None}
    # turn 0: a-r-> {m}, b-t-> {x, y, a}; turn 1: m-s-> {a, x, z} minus start a -> {x, z}; {x, z} ∩ {x, y, a} = {x}
    turns, final = _drive(plan, [[[("m", "m")], [("x", "X"), ("y", "Y"), ("a", "A")]], [[("a", "A"), ("x", "X"), ("z", "Z")]]])
    assert [len(t) for t in turns] == [2, 1]
    assert final == [("x", "X")]


def test_run_plan_prunes_dead_branches():
    store = MemoryStore.from_triples([("a", "r", "m1"), ("a", "r", "m2"), ("m1", "s", "z"), ("m2", "u", "w")])
    plan = {"paths": [{"start": ["a"], "hops": [{"verb": "get_tail_entities", "relation": "r"}, {"verb": "get_tail_entities", "relation": "s"}]}], "filter": None}
    turns, answers, triples = run_plan(plan, store)
    assert answers == ["z"]
    assert [len(t) for t in turns] == [1, 2]  # m2 is asked too, and answers nothing
    assert triples == [("a", "r", "m1"), ("m1", "s", "z")]  # a-r->m2 leads nowhere: pruned


def test_parse_observation():
    assert parse_observation('["Bob Vance (m.bob)", "m.cvt"] (3 more not shown)\nHint: x') == [("m.bob", "Bob Vance"), ("m.cvt", "m.cvt")]
    assert parse_observation('["Alice (1990)"]', ids_are_names=True) == [("Alice (1990)", "Alice (1990)")]
    assert parse_observation("ERROR: unknown entity") == []
    assert parse_observation("[]") == []
    assert parse_observation('{"a": 1}') == []
    assert parse_observation('[1, null, "x"]') == [("x", "x")]


def test_oracle_without_plan_and_null_policy():
    task = Task(id="t", question="q", answers=["x"])
    assert oracle_policy(task, []) == "<answer>unknown</answer>"
    assert null_policy(task, []) == "<answer>unknown</answer>"


def test_oracle_skips_an_answer_that_normalises_to_nothing():
    plan = {"paths": [{"start": ["p"], "hops": [{"verb": "get_head_entities", "relation": "starred_actors"}]}], "filter": None}
    task = Task(id="t", question="q", answers=["10", "$"], meta={"plan": plan, "entity_ids_are_names": True})
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": json.dumps(["$", "10"])}]
    assert oracle_policy(task, messages) == "<answer>10</answer>"


@needs_data
@pytest.mark.parametrize("questions, kb, expected, uncapped", [
    ("PQ-2H.txt", "2H-kb.txt", 1908, 1908),
    ("PQ-3H.txt", "3H-kb.txt", 5198, 5198),
    ("PQL-2H.txt", "PQL2-KB.txt", 1588, 1594),
])
def test_pathquestion_oracle(questions, kb, expected, uncapped):
    store = load_store(DATA / "pathquestion" / kb)
    tasks = load_tasks(DATA / "pathquestion" / questions, store=store)
    assert em_count(KGEnv(store), tasks) == expected
    assert em_count(KGEnv(store, KGEnvConfig(max_items=10**6)), tasks) == uncapped == len(tasks)
    # ceiling: the gold relation chain reproduces the exact gold answer set
    assert sum(set(run_plan(t.meta["plan"], store)[1]) == set(t.answers) for t in tasks) == len(tasks)
    assert em_count(KGEnv(store), tasks[:300], null_policy) == 0


@needs_data
def test_metaqa_oracle_on_consistent_samples():
    store = load_store(DATA / "metaqa" / "kb.txt.gz")
    for name in ("1hop_dev", "2hop_dev"):
        tasks = load_tasks(DATA / "metaqa" / "qa" / f"{name}.jsonl.gz", store=store)[:2000]
        assert em_count(KGEnv(store), tasks) == 2000, name
        assert em_count(KGEnv(store), tasks[:200], null_policy) == 0
