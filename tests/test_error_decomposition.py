"""Error decomposition of failed KG episodes by replaying the gold path, on a tiny fake store."""

from __future__ import annotations

import pytest

from keel.diagnostics.errors import classify_failure, decompose_errors
from keel.types import Observation, Step, Task, ToolCall, Trajectory

SPOUSE, BIRTH, CHILD, SCHOOL = "people.person.spouse_s", "people.person.place_of_birth", "people.person.children", "people.person.education"


class FakeStore:
    """The KGStore protocol over a handful of triples."""

    def __init__(self, triples, names):
        self.triples, self.names = triples, names

    def tail_relations(self, entity):
        return sorted({r for h, r, _ in self.triples if h == entity})

    def head_relations(self, entity):
        return sorted({r for _, r, t in self.triples if t == entity})

    def tail_entities(self, entity, relation):
        return sorted({t for h, r, t in self.triples if h == entity and r == relation})

    def head_entities(self, entity, relation):
        return sorted({h for h, r, t in self.triples if t == entity and r == relation})

    def has_entity(self, entity):
        return any(entity in (h, t) for h, _, t in self.triples)

    def name(self, entity):
        return self.names.get(entity)

    def has_relation(self, relation):
        return any(r == relation for _, r, _ in self.triples)


STORE = FakeStore(
    [("m.x", SPOUSE, "m.s"), ("m.s", BIRTH, "m.hon"), ("m.x", CHILD, "m.k"), ("m.x", BIRTH, "m.sw"), ("m.s", SCHOOL, "m.pr")],
    {"m.x": "X Person", "m.s": "Michelle Obama", "m.hon": "Honolulu", "m.k": "Kid", "m.sw": "Somewhere", "m.pr": "Princeton"},
)
TASK = Task(id="q", question="Where was X's spouse born?", answers=["Honolulu"], answer_ids=["m.hon"],
            topic_entities={"m.x": "X Person"}, gold_triples=[("m.x", SPOUSE, "m.s"), ("m.s", BIRTH, "m.hon")])


def call(verb, obs, entity, relation=None, error=None):
    args = {"entity": entity} if relation is None else {"entity": entity, "relation": relation}
    return Step(0, ToolCall(verb if not error else "", args if not error else {}, error=error), Observation(obs, ok=obs != "[]"))


def traj(steps, answer, task_id="q"):
    return Trajectory(task_id=task_id, token_ids=[], sources=[], logprobs=[], steps=steps, answer=answer)


HOP0 = call("get_tail_entities", '["Michelle Obama (m.s)"]', "m.x", SPOUSE)
CASES = [
    ("no answer", traj([HOP0], None), "format", None),
    ("empty answer", traj([HOP0], "  "), "format", None),
    ("no call parsed", traj([call("", "ERROR: bad json", "", error="bad_json")], "Paris"), "format", None),
    ("answer from memory", traj([], "Paris"), "no_retrieval", None),
    ("only empty results", traj([call("get_tail_entities", "[]", "m.x", "made.up")], "Paris"), "no_retrieval", None),
    ("answer seen, not used", traj([HOP0, call("get_tail_entities", '["Honolulu (m.hon)"]', "m.s", BIRTH)], "Hilo"), "answer_extraction", None),
    ("wrong relation at the topic", traj([call("get_tail_relations", f'["{CHILD}"]', "m.x"), call("get_tail_entities", '["Kid (m.k)"]', "m.x", CHILD)], "Kid"), "relation_selection", 0),
    ("gold relation on the wrong entity", traj([HOP0, call("get_tail_entities", '["Somewhere (m.sw)"]', "m.x", BIRTH)], "Somewhere"), "composition", 1),
    ("stopped after hop 0", traj([HOP0], "Michelle Obama"), "composition", 1),
    ("right entity by name, wrong relation", traj([HOP0, call("get_tail_entities", '["Princeton (m.pr)"]', "Michelle Obama", SCHOOL)], "Princeton"), "relation_selection", 1),
]


@pytest.mark.parametrize("name,t,category,hop", CASES, ids=[c[0] for c in CASES])
def test_each_category(name, t, category, hop):
    r = classify_failure(t, TASK, STORE)
    assert (r["category"], r["hop"]) == (category, hop), r


def test_unverifiable_and_reverse_path():
    broken = Task(id="b", question="?", answers=["Y"], topic_entities={"m.x": "X"}, gold_triples=[("m.x", "no.such", "m.y")])
    assert classify_failure(traj([HOP0], "Z", "b"), broken, STORE)["category"] == "unverifiable"
    no_path = Task(id="n", question="?", answers=["Y"], topic_entities={"m.x": "X"})
    assert classify_failure(traj([HOP0], "Z", "n"), no_path, STORE)["detail"] == "task has no gold triples"
    # Topic entity at the tail: "Whose spouse is Michelle Obama?" walks (m.x, spouse, m.s) backwards.
    reverse = Task(id="r", question="?", answers=["X Person"], answer_ids=["m.x"], topic_entities={"m.s": "Michelle Obama"},
                   gold_triples=[("m.x", SPOUSE, "m.s")])
    wrong_rel = traj([call("get_head_entities", '["Princeton (m.pr)"]', "m.s", SCHOOL)], "Princeton", "r")
    assert (classify_failure(wrong_rel, reverse, STORE)["category"], classify_failure(wrong_rel, reverse, STORE)["hop"]) == ("relation_selection", 0)


def test_decompose_shares():
    trajs = [t for _, t, _, _ in CASES] + [traj([HOP0, call("get_tail_entities", '["Honolulu (m.hon)"]', "m.s", BIRTH)], "Honolulu")]
    out = decompose_errors(trajs, [TASK], STORE)
    # 11 episodes, 1 correct → 10 failed: format 3, no_retrieval 2, answer_extraction 1,
    # relation_selection 2, composition 2; retrieval-dependent 5 → composition 2/5 = 0.4.
    assert (out["episodes"], out["failed"], out["retrieval_dependent"]) == (11, 10, 5)
    assert out["counts"] == {"format": 3, "no_retrieval": 2, "unverifiable": 0, "answer_extraction": 1, "relation_selection": 2, "composition": 2}
    assert out["shares"]["format"] == pytest.approx(0.3)
    assert out["retrieval_shares"] == pytest.approx({"relation_selection": 0.4, "composition": 0.4, "answer_extraction": 0.2})
    with pytest.raises(ValueError, match="no task"):
        decompose_errors([traj([], "x", "missing")], [TASK], STORE)


def test_calls_are_read_as_the_env_executed_them():
    # "Michelle Obama (m.s)" is m.s to the env: the model stood at the hop-1 entity and chose the
    # wrong relation (read from the raw argument, it would look like it never carried m.s over).
    from keel.kg.env import KGEnv

    episode = KGEnv(STORE).start(TASK)
    steps = [Step(0, ToolCall(v, a), episode.execute(ToolCall(v, a))) for v, a in (
        ("get_tail_entities", {"entity": "m.x", "relation": SPOUSE}),
        ("get_tail_entities", {"entity": "Michelle Obama (m.s)", "relation": SCHOOL}),
    )]
    record = classify_failure(traj(steps, "Princeton"), TASK, STORE)
    assert (record["category"], record["hop"]) == ("relation_selection", 1)
