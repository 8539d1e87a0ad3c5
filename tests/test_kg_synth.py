"""The synthetic Freebase-like KG: determinism, shape, and answers checked against the graph
by hand-written lookups (not through the plan executor that produced them)."""

import json
import re

import pytest

from keel.kg import synth
from keel.kg.loaders import load_store, load_tasks
from keel.kg.store import NAME_RELATION


@pytest.fixture(scope="module")
def generated():
    return synth.generate_splits(seed=0)


def test_same_seed_byte_identical_other_seed_different(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    synth.generate(a, seed=3, train=60, dev=10, test=20)
    synth.generate(b, seed=3, train=60, dev=10, test=20)
    synth.generate(c, seed=4, train=60, dev=10, test=20)
    files = ["kb.tsv", "train.jsonl", "dev.jsonl", "test.jsonl", "meta.json"]
    assert sorted(p.name for p in a.iterdir()) == sorted(files)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for name in ("kb.tsv", "train.jsonl"):
        assert (a / name).read_bytes() != (c / name).read_bytes(), name


def test_refuses_non_empty_dir_unless_overwrite(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty; pass overwrite=True"):
        synth.generate(tmp_path, seed=0, train=10, dev=5, test=5)
    meta = synth.generate(tmp_path, seed=0, train=10, dev=5, test=5, overwrite=True)
    assert meta["counts"]["train"] == 10 and (tmp_path / "keep.txt").exists()
    with pytest.raises(FileExistsError, match="not a directory"):
        synth.generate(tmp_path / "keep.txt", seed=0)


def test_too_many_questions_asked_is_a_clear_error():
    with pytest.raises(ValueError, match="distinct questions"):
        synth.generate_splits(seed=0, train=100_000)


def test_files_load_back_identically(tmp_path, generated):
    kg, splits = generated
    meta = synth.generate(tmp_path, seed=0)
    store = load_store(tmp_path / "kb.tsv")
    assert list(store.iter_triples()) == list(kg.store.iter_triples())
    for split in ("train", "dev", "test"):
        assert [t.to_dict() for t in load_tasks(tmp_path / f"{split}.jsonl")] == [t.to_dict() for t in splits[split]]
    assert meta["counts"] == {"triples": kg.store.num_triples, "entities": len(kg.store.entities()), "names": len(kg.store.names),
                              "train": 1000, "dev": 100, "test": 200}
    assert meta["relations"] == synth.RELATIONS
    assert json.loads((tmp_path / "meta.json").read_text())["seed"] == 0


def test_graph_shape(generated):
    kg, _ = generated
    s = kg.store
    assert 10 <= len(s.relations()) <= 16 and s.relations() == synth.RELATIONS
    named = [e for e in s.entities() if s.name(e)]
    assert all(re.fullmatch(r"m\.0[0-9a-z_]{5}", e) for e in named)
    # CVTs: nameless mediators, as in Freebase
    marriages = [e for e, k in kg.kind_of.items() if k == "marriage"]
    performances = [e for e, k in kg.kind_of.items() if k == "performance"]
    assert len(marriages) == 180 and len(performances) > 400
    assert all(s.name(m) is None and len(s.tail_entities(m, synth.MARRIAGE_SPOUSE)) == 2 for m in marriages)
    assert sum(1 for al in kg.aliases.values() for _ in al) > 20
    assert NAME_RELATION not in s.relations()
    assert len(set(s.names.values())) == len(s.names)  # names are unique in this graph


def test_splits_distinct_balanced_and_short(generated):
    _, splits = generated
    questions = [t.question for tasks in splits.values() for t in tasks]
    assert len(questions) == len(set(questions)) == 1300
    for tasks in splits.values():
        kinds = {t.kind for t in tasks}
        assert kinds == {"composition", "conjunction", "comparative", "superlative"}
    train = splits["train"]
    for kind in ("composition", "conjunction", "comparative", "superlative"):
        assert 150 <= sum(t.kind == kind for t in train) <= 350
    for t in train:
        assert 1 <= len(t.gold_turns) <= 3 and all(1 <= len(turn) <= 6 for turn in t.gold_turns)
        assert t.answers and len(t.answers) == len(t.answer_ids)
        assert all(topic in t.question or name in t.question for topic, name in t.topic_entities.items())


def test_answers_match_hand_written_lookups(generated):
    kg, splits = generated
    s = kg.store
    checked = set()
    for t in splits["train"] + splits["test"]:
        template = t.meta["template"]
        topic = next(iter(t.topic_entities))
        if template == "director_birthplace":
            (director,) = s.tail_entities(topic, synth.DIRECTED_BY)
            expected = s.tail_entities(director, synth.PLACE_OF_BIRTH)
        elif template == "spouse":
            (marriage,) = s.tail_entities(topic, synth.SPOUSE_S)
            expected = [p for p in s.tail_entities(marriage, synth.MARRIAGE_SPOUSE) if p != topic]
        elif template == "first_film":
            films = s.head_entities(topic, synth.DIRECTED_BY)
            years = {f: int(s.tail_entities(f, synth.RELEASE_YEAR)[0]) for f in films}
            expected = [min(films, key=years.get)]
            assert sorted(years.values()).count(min(years.values())) == 1  # no tie
        elif template == "films_before":
            cut = int(re.search(r"before (\d+)\?", t.question).group(1))
            expected = [f for f in s.head_entities(topic, synth.DIRECTED_BY) if int(s.tail_entities(f, synth.RELEASE_YEAR)[0]) < cut]
        elif template == "shared_actor":
            a, b = t.topic_entities
            actors = lambda film: {x for p in s.tail_entities(film, synth.STARRING) for x in s.tail_entities(p, synth.PERFORMANCE_ACTOR)}
            expected = sorted(actors(a) & actors(b))
        elif template == "profession_born_in":
            city, profession = t.topic_entities
            expected = [p for p in s.head_entities(city, synth.PLACE_OF_BIRTH) if s.tail_entities(p, synth.PROFESSION) == [profession]]
        else:
            continue
        checked.add(template)
        assert sorted(t.answer_ids) == sorted(expected), t.question
        assert t.answers == [s.name(a) for a in t.answer_ids]
    assert checked == {"director_birthplace", "spouse", "first_film", "films_before", "shared_actor", "profession_born_in"}


def test_gold_turns_execute_to_nonempty_results(generated):
    kg, splits = generated
    s = kg.store
    for t in splits["dev"]:
        for turn in t.gold_turns:
            for call in turn:
                verb = s.tail_entities if call["name"] == "get_tail_entities" else s.head_entities
                assert verb(call["arguments"]["entity"], call["arguments"]["relation"]), (t.question, call)
        for h, r, tail in t.gold_triples:
            assert tail in s.tail_entities(h, r)


def test_sizes_configurable():
    kg, splits = synth.generate_splits(seed=1, train=30, dev=7, test=9, config=synth.SynthConfig(people=300, films=150, directors=40, marriages=60))
    assert [len(splits[k]) for k in ("train", "dev", "test")] == [30, 7, 9]
    assert len([e for e, k in kg.kind_of.items() if k == "person"]) == 300
    assert splits["dev"][0].id == "synth-s1-dev-0000"


def test_kinds_subset_is_the_same_graph_and_questions_of_those_kinds():
    _, full = synth.generate_splits(seed=0, train=80, dev=10, test=10)
    _, only = synth.generate_splits(seed=0, train=80, dev=10, test=10, config=synth.SynthConfig(kinds=("composition",)))
    asked = [t for split in only.values() for t in split]
    assert {t.kind for t in asked} == {"composition"} and len(asked) == 100
    # the candidate pools are drawn as for all four kinds: the full set's composition questions are among the subset's
    full_composition = {t.question for split in full.values() for t in split if t.kind == "composition"}
    assert full_composition and full_composition <= {t.question for t in asked}
    with pytest.raises(ValueError, match="question kinds"):
        synth.generate_splits(seed=0, train=8, dev=1, test=1, config=synth.SynthConfig(kinds=("composition", "trivia")))


def test_max_hops_keeps_only_short_questions():
    _, splits = synth.generate_splits(seed=0, train=60, dev=5, test=5, config=synth.SynthConfig(kinds=("composition",), max_hops=2))
    asked = [t for split in splits.values() for t in split]
    assert all(len(t.gold_turns) <= 2 for t in asked)
    templates = {t.meta["template"] for t in asked}
    assert "spouse" in templates and not templates & {"spouse_birthplace", "birth_country_capital"}  # the 3-hop chains are gone


def test_template_names_are_the_generators():
    from keel.config import QUESTION_TEMPLATES

    _, splits = synth.generate_splits(seed=0, train=900, dev=50, test=50)
    seen: dict[str, set[str]] = {}
    for t in (t for split in splits.values() for t in split):
        seen.setdefault(t.kind, set()).add(t.meta["template"])
    assert {k: set(v) for k, v in QUESTION_TEMPLATES.items()} == seen


def test_templates_subset_keeps_only_those_templates_taken_in_turn():
    keep = ("director_birthplace", "film_actors", "spouse")
    _, splits = synth.generate_splits(seed=0, train=60, dev=3, test=3, config=synth.SynthConfig(kinds=("composition",), templates=keep))
    asked = [t for split in splits.values() for t in split]
    counts = {k: sum(t.meta["template"] == k for t in asked) for k in keep}
    assert sum(counts.values()) == 66 and set(counts) == set(keep)
    assert max(counts.values()) - min(counts.values()) <= 1  # in turn, so each about a third


def test_templates_outside_the_kinds_are_a_config_error():
    from keel.config import load_config

    with pytest.raises(ValueError, match=r"data.templates: \['first_film'\] are not templates of data.kinds"):
        load_config(None, ["data.kinds=[composition]", "data.templates=[spouse,first_film]"])


def _nationality_is_birth_country(kg) -> float:
    s = kg.store
    people = [p for p in kg.people if s.tail_entities(p, synth.PLACE_OF_BIRTH)]
    same = sum(s.tail_entities(p, synth.NATIONALITY) == s.tail_entities(s.tail_entities(p, synth.PLACE_OF_BIRTH)[0], synth.CONTAINEDBY)
               for p in people)
    return same / len(people)


def test_nationality_from_birth_sets_the_shortcut_share_and_nothing_else():
    default, _ = synth.generate_splits(seed=0, train=50, dev=5, test=5)
    same, _ = synth.generate_splits(seed=0, train=50, dev=5, test=5, config=synth.SynthConfig(nationality_from_birth=0.8))
    apart, _ = synth.generate_splits(seed=0, train=50, dev=5, test=5, config=synth.SynthConfig(nationality_from_birth=0.0))
    assert list(default.store.iter_triples()) == list(same.store.iter_triples())  # the default graph is unchanged
    # 0.8 of 700 people plus 1/24 of the rest; 0: 1/24 by chance alone (24 countries)
    assert 0.78 < _nationality_is_birth_country(default) < 0.88
    assert _nationality_is_birth_country(apart) < 0.08
    # only nationality triples differ: same people, same places of birth, same questions asked
    changed = set(default.store.iter_triples()) ^ set(apart.store.iter_triples())
    assert changed and {r for _, r, _ in changed} == {synth.NATIONALITY}
    # composition questions name no nationality: the same ones are asked, in the same order
    composition = synth.SynthConfig(kinds=("composition",))
    _, ref = synth.generate_splits(seed=0, train=50, dev=5, test=5, config=composition)
    _, got = synth.generate_splits(seed=0, train=50, dev=5, test=5, config=synth.SynthConfig(kinds=("composition",), nationality_from_birth=0.0))
    assert [t.question for t in got["train"]] == [t.question for t in ref["train"]]


def test_rl_templates_narrow_the_dev_set_and_the_rl_pool_not_the_sft_pool(tmp_path):
    from keel import tasks as task_builder
    from keel.config import load_config

    cfg = load_config(None, ["data.kinds=[composition]", "data.templates=[birthplace_country,director_birthplace,spouse]",
                             "data.rl_templates=[birthplace_country,director_birthplace]", "data.n_train=30", "data.n_dev=12",
                             "data.n_test=3"])
    _, train, dev = task_builder.build(cfg, tmp_path)
    assert {t.meta["template"] for t in train} == {"birthplace_country", "director_birthplace", "spouse"}  # all 30: SFT's
    assert len(train) == 30 and {t.meta["template"] for t in dev} == {"birthplace_country", "director_birthplace"}
    written = [json.loads(x) for x in (tmp_path / "data" / "dev.jsonl").read_text().splitlines()]
    assert len(written) == 12 and [t.id for t in dev] == [q["id"] for q in written if q["meta"]["template"] != "spouse"]
    rl = task_builder.rl_pool(cfg, train, "training")
    assert [t.id for t in rl] == [t.id for t in train if t.meta["template"] != "spouse"] and 0 < len(rl) < 30
    cfg.data.rl_templates = ["spouse"]
    with pytest.raises(task_builder.DataError, match=r"data.rl_templates \['spouse'\]: no dev question"):
        task_builder.rl_pool(cfg, dev, "dev")


def test_sft_templates_narrow_the_warm_start_and_nothing_else(tmp_path):
    from keel import tasks as task_builder
    from keel.config import load_config

    cfg = load_config(None, ["data.kinds=[composition]", "data.templates=[birthplace_country,director_birthplace,spouse,director_nationality]",
                             "data.rl_templates=[birthplace_country,director_birthplace]", "data.sft_templates=[spouse,director_nationality]",
                             "data.n_train=40", "data.n_dev=12", "data.n_test=3"])
    _, train, dev = task_builder.build(cfg, tmp_path)
    assert len(train) == 40 and {t.meta["template"] for t in dev} == {"birthplace_country", "director_birthplace"}
    sft, rl = task_builder.sft_pool(cfg, train), task_builder.rl_pool(cfg, train, "training")
    assert [t.id for t in sft] == [t.id for t in train if t.meta["template"] in ("spouse", "director_nationality")]
    assert [t.id for t in rl] == [t.id for t in train if t.meta["template"] in ("birthplace_country", "director_birthplace")]
    assert len(sft) + len(rl) == 40 and sft and rl  # disjoint here: RL's templates are never in the warm-start
    cfg.data.sft_templates = []
    assert task_builder.sft_pool(cfg, train) == train
    cfg.data.sft_templates = ["birth_country_capital"]  # a known template this dataset has no question of
    with pytest.raises(task_builder.DataError, match=r"data.sft_templates \['birth_country_capital'\]: no training question"):
        task_builder.sft_pool(cfg, train)


def test_sft_templates_outside_data_templates_are_a_config_error():
    from keel.config import load_config

    with pytest.raises(ValueError, match=r"data.sft_templates: \['spouse'\] are not among data.templates"):
        load_config(None, ["data.kinds=[composition]", "data.templates=[birthplace_country]", "data.sft_templates=[spouse]"])
    with pytest.raises(ValueError, match=r"data.sft_templates selects knowledge-graph question templates; env.kind=fc_learn"):
        load_config(None, ["env.kind=fc_learn", "data.kinds=[composition]", "data.sft_templates=[spouse]"])


def test_rl_templates_outside_data_templates_are_a_config_error():
    from keel.config import load_config

    with pytest.raises(ValueError, match=r"data.rl_templates: \['spouse'\] are not among data.templates"):
        load_config(None, ["data.kinds=[composition]", "data.templates=[birthplace_country]", "data.rl_templates=[spouse]"])
    with pytest.raises(ValueError, match=r"data.rl_templates: \['first_film'\] are not among data.templates"):
        load_config(None, ["data.kinds=[composition]", "data.rl_templates=[first_film]"])
    with pytest.raises(ValueError, match=r"data.rl_templates selects knowledge-graph question templates; env.kind=fc_learn"):
        load_config(None, ["env.kind=fc_learn", "data.kinds=[composition]", "data.rl_templates=[spouse]"])
