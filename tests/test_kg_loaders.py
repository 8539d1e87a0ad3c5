"""Loaders against the real files in ../shared/data (counts from their READMEs) and bad inputs."""

import gzip
import json
from pathlib import Path

import pytest

from keel.kg.loaders import load_store, load_tasks, read_triples
from keel.kg.store import NAME_RELATION
from keel.types import Task

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PQ = DATA / "kg" / "pathquestion"
METAQA = DATA / "kg" / "metaqa"
CWQ = DATA / "kgqa" / "cwq_test_tog.json"

needs_data = pytest.mark.skipif(not PQ.is_dir(), reason="../shared/data is not present")


@needs_data
@pytest.mark.parametrize("kb, triples, entities, relations", [
    ("2H-kb.txt", 1211, 1056, 13),  # the README's table
    ("3H-kb.txt", 2839, 1836, 13),
    ("PQL2-KB.txt", 4247, 5034, 363),
])
def test_pathquestion_kbs(kb, triples, entities, relations):
    store = load_store(PQ / kb)
    assert (store.num_triples, len(store.entities()), len(store.relations())) == (triples, entities, relations)


@pytest.fixture(scope="module")
def metaqa_store():
    return load_store(METAQA / "kb.txt.gz")


@needs_data
def test_metaqa_kb_pipe_separated_gzipped(metaqa_store):
    store = metaqa_store
    assert (store.num_triples, len(store.entities()), len(store.relations())) == (130_173, 42_873, 9)  # stats.json
    assert "Kevin McKidd" in store.tail_entities("16 Years of Alcohol", "starred_actors")
    # the additions file is already inside kb.txt.gz: the union adds nothing
    assert load_store([METAQA / "kb.txt.gz", METAQA / "kb_additions_from_1hop_qa.txt"]).num_triples == 130_173


@needs_data
def test_pathquestion_tasks():
    tasks = load_tasks(PQ / "PQ-2H.txt")
    assert len(tasks) == 1908
    t = tasks[0]
    assert t.question == "which nationality is frederica_of_mecklenburg-strelitz 's couple ?"
    assert t.answers == ["united_kingdom"] and t.kind == "2-hop"
    assert t.topic_entities == {"frederica_of_mecklenburg-strelitz": "frederica_of_mecklenburg-strelitz"}
    assert t.gold_turns == [
        [{"name": "get_tail_entities", "arguments": {"entity": "frederica_of_mecklenburg-strelitz", "relation": "spouse"}}],
        [{"name": "get_tail_entities", "arguments": {"entity": "ernest_augustus_i_of_hanover", "relation": "nationality"}}],
    ]
    assert t.gold_triples == [("frederica_of_mecklenburg-strelitz", "spouse", "ernest_augustus_i_of_hanover"),
                              ("ernest_augustus_i_of_hanover", "nationality", "united_kingdom")]
    three = load_tasks(PQ / "PQ-3H.txt")
    assert len(three) == 5198 and all(len(x.gold_turns) == 3 for x in three)
    pql = load_tasks(PQ / "PQL-2H.txt")
    assert len(pql) == 1594 and pql[0].question.startswith("what is the notable_types")  # leading space stripped
    store = load_store(PQ / "PQL2-KB.txt")
    assert all(tail in store.tail_entities(h, r) for x in pql for h, r, tail in x.gold_triples)  # README: 100% in KB


@needs_data
def test_metaqa_tasks_consistent_only_by_default():
    tasks = load_tasks(METAQA / "qa" / "1hop_dev.jsonl.gz")
    assert len(tasks) == 9454  # stats.json: gold_consistent of 1hop_dev
    assert len(load_tasks(METAQA / "qa" / "1hop_dev.jsonl.gz", consistent_only=False)) == 9992
    t = tasks[0]
    assert t.answers == ["Once Were Warriors", "Tracker", "River Queen"] and t.topic_entities == {"Temuera Morrison": "Temuera Morrison"}
    assert t.meta["plan"]["paths"][0]["hops"] == [{"verb": "get_head_entities", "relation": "starred_actors", "exclude_start": True}]
    assert t.gold_turns == []  # without a store the intermediate entities are unknown


@needs_data
def test_metaqa_gold_turns_with_store(metaqa_store):
    store = metaqa_store
    tasks = load_tasks(METAQA / "qa" / "2hop_dev.jsonl.gz", store=store)[:50]
    first = tasks[0]  # "what are the languages spoken in the films directed by [Joel Zwick]" -> ["Greek"]
    assert first.gold_turns[0] == [{"name": "get_head_entities", "arguments": {"entity": "Joel Zwick", "relation": "directed_by"}}]
    films = store.head_entities("Joel Zwick", "directed_by")
    assert [c["arguments"]["entity"] for c in first.gold_turns[1]] == films
    assert {t for _, r, t in first.gold_triples if r == "in_language"} == {"Greek"}


@needs_data
def test_cwq_tog_file():
    tasks = load_tasks(CWQ)
    assert len(tasks) == 3531
    kinds = {k: sum(t.kind == k for t in tasks) for k in ("conjunction", "composition", "comparative", "superlative")}
    assert kinds == {"conjunction": 1575, "composition": 1546, "comparative": 213, "superlative": 197}  # the README
    assert sum(not t.topic_entities for t in tasks) == 11
    t = tasks[0]
    assert t.id == "WebQTest-832_c334509bb5e02cacae1ba2e80c176499"
    assert t.answers == ["2014 World Series"] and t.topic_entities == {"m.03_dwn": "Lou Seal"}
    assert t.meta["relations"] == ["sports.sports_team.team_mascot", "sports.sports_team.championships", "time.event.start_date"]


def test_cwq_original_format(tmp_path):
    record = {
        "ID": "WebQTrn-1_abc",
        "question": "What country bordering France has the Euro?",
        "compositionality_type": "conjunction",
        "sparql": "SELECT ?x WHERE { ns:m.0f8l9c ns:location.location.adjoin_s ?y . ?y ns:location.adjoining_relationship.adjoins ?x . }",
        "answers": [{"answer": "Belgium", "answer_id": "m.0154j", "aliases": ["Kingdom of Belgium"]},
                    {"answer": "Germany", "answer_id": "m.0345h", "aliases": []}],
    }
    path = tmp_path / "cwq.json"
    path.write_text(json.dumps([record]))
    (t,) = load_tasks(path)
    assert t.answers == ["Belgium", "Germany"] and t.aliases == ["Kingdom of Belgium"]
    assert t.answer_ids == ["m.0154j", "m.0345h"] and t.topic_entities == {"m.0f8l9c": ""}
    assert t.kind == "conjunction"
    assert t.meta["relations"] == ["location.location.adjoin_s", "location.adjoining_relationship.adjoins"]
    jsonl = tmp_path / "cwq.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    assert load_tasks(jsonl)[0].to_dict() == t.to_dict()


def test_keel_jsonl_round_trip(tmp_path):
    task = Task(id="a", question="q?", answers=["x"], gold_triples=[("h", "r", "t")], meta={"k": 1})
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(task.to_dict()) + "\n\n" + json.dumps(task.to_dict()) + "\n")
    assert [t.to_dict() for t in load_tasks(path)] == [task.to_dict()] * 2


def test_triple_files_tsv_pipe_gz_names(tmp_path):
    tsv = tmp_path / "kb.tsv"
    tsv.write_text("m.1\tr.a.b\tm.2\n\nm.1\ttype.object.name\tOne (the first)\nm.2\tr.a.b\tm.3\r\n")
    store = load_store(tsv)
    assert store.num_triples == 2 and store.name("m.1") == "One (the first)"
    assert store.tail_entities("m.1", NAME_RELATION) == []
    pipe = tmp_path / "kb.txt.gz"
    with gzip.open(pipe, "wt") as f:
        f.write("A|rel|B\nB|rel|C\n")
    assert load_store(pipe).tail_entities("A", "rel") == ["B"]
    assert list(read_triples(pipe)) == [("A", "rel", "B"), ("B", "rel", "C")]


@pytest.mark.parametrize("content, where", [
    ("a\tr\tb\na\tr\n", ":2: expected 3 non-empty tab-separated fields, got 2"),
    ("a|r|b\n\n\na|r|b|c\n", ":4: expected 3 non-empty '|'-separated fields, got 4"),
    ("a\tr\t\n", ":1: expected 3 non-empty tab-separated fields, got 3"),
    ("just words\n", ":1: neither a tab nor '|'"),
])
def test_malformed_triple_line_names_file_and_line(tmp_path, content, where):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    with pytest.raises(ValueError, match="bad.tsv" + where.replace("|", r"\|")):
        load_store(path)


def test_missing_files_and_unknown_formats(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file: .*nope.tsv"):
        load_store(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="load_tasks: no such file: .*nope.jsonl"):
        load_tasks(tmp_path / "nope.jsonl")
    odd = tmp_path / "odd.txt"
    odd.write_text("hello world\n")
    with pytest.raises(ValueError, match="cannot tell the format of .*odd.txt"):
        load_tasks(odd)
    with pytest.raises(ValueError, match="unknown format 'xml' for .*odd.txt"):
        load_tasks(odd, fmt="xml")


def test_malformed_records_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "question": "q", "answers": ["x"]}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(bad)
    pq = tmp_path / "pq.txt"
    pq.write_text("q ?\ta(a/)\ttopic#rel#a\nq2 ?\tb(b/)\ttopic#rel\n")
    with pytest.raises(ValueError, match=r"pq.txt:2: gold path 'topic#rel'"):
        load_tasks(pq)
    cwq = tmp_path / "cwq.json"
    cwq.write_text(json.dumps([{"ID": "x", "answer": "y"}]))
    with pytest.raises(ValueError, match="cwq.json: CWQ record 0 lacks a field"):
        load_tasks(cwq)
    metaqa = tmp_path / "m.jsonl"
    metaqa.write_text(json.dumps({"id": "m", "question": "q", "relation_path": [["fwd", "r"]], "gold_consistent": True}) + "\n")
    with pytest.raises(ValueError, match="m.jsonl:1: MetaQA record lacks a field"):
        load_tasks(metaqa)


def test_pathquestion_answer_sets_with_parentheses(tmp_path):
    path = tmp_path / "pq.txt"
    path.write_text("who ?\tx_(band)(x_(band)/y/)\ttopic#rel#x_(band)#<end>#x_(band)\n")
    (t,) = load_tasks(path)
    assert t.answers == ["x_(band)", "y"]
    assert t.gold_turns == [[{"name": "get_tail_entities", "arguments": {"entity": "topic", "relation": "rel"}}]]
