"""KGEnv: exact observations, the four interface switches, and a fuzz of malformed calls."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.chat import parse_tool_calls
from keel.episode import process_turn
from keel.kg.env import KGEnv, KGEnvConfig, opaque_relation_name, split_display
from keel.kg.store import MemoryStore
from keel.rewards import is_empty_observation
from keel.types import Observation, Task, ToolCall

TRIPLES = [
    ("m.film", "film.film.directed_by", "m.bob"),
    ("m.film", "film.film.starring", "m.perf0"),
    ("m.film", "film.film.starring", "m.perf1"),
    ("m.perf0", "film.performance.actor", "m.alice"),
    ("m.perf1", "film.performance.actor", "m.bob"),
    ("m.bob", "people.person.place_of_birth", "m.paris"),
    ("m.alice", "people.person.place_of_birth", "m.paris"),
    ("m.carl", "people.person.place_of_birth", "m.paris"),
    ("m.bob", "people.person.date_of_birth", "1950"),
]
NAMES = {"m.film": "Heat", "m.bob": "Bob Vance", "m.alice": "Alice", "m.paris": "Paris", "m.carl": "Carl"}
STORE = MemoryStore.from_triples(TRIPLES, NAMES)
TASK = Task(
    id="t0",
    question="Where was the director of Heat born?",
    answers=["Paris"],
    topic_entities={"m.film": "Heat"},
    gold_turns=[
        [{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}],
        [{"name": "get_tail_entities", "arguments": {"entity": "m.bob", "relation": "people.person.place_of_birth"}}],
    ],
    gold_triples=[("m.film", "film.film.directed_by", "m.bob"), ("m.bob", "people.person.place_of_birth", "m.paris")],
    meta={"plan": {"paths": [{"start": ["m.film"], "hops": [
        {"verb": "get_tail_entities", "relation": "film.film.directed_by", "exclude_start": False},
        {"verb": "get_tail_entities", "relation": "people.person.place_of_birth", "exclude_start": False}]}], "filter": None}},
)


def run(config=None, name="get_tail_entities", **arguments):
    return KGEnv(STORE, config).start(TASK).execute(ToolCall(name=name, arguments=arguments))


def test_tools_are_the_four_verbs():
    tools = KGEnv(STORE).tools(TASK)
    assert [t["function"]["name"] for t in tools] == ["get_tail_relations", "get_head_relations", "get_tail_entities", "get_head_entities"]
    assert [t["function"]["parameters"]["required"] for t in tools] == [["entity"], ["entity"], ["entity", "relation"], ["entity", "relation"]]


def test_entity_observation_exact():
    obs = run(entity="m.film", relation="film.film.starring")
    assert obs.text == '["m.perf0", "m.perf1"]'  # CVTs have no name: the id alone
    assert obs.ok and obs.error is None and obs.items == ["m.perf0", "m.perf1"]
    obs = run(name="get_head_entities", entity="m.paris", relation="people.person.place_of_birth")
    assert obs.text == '["Alice (m.alice)", "Bob Vance (m.bob)", "Carl (m.carl)"]'
    assert obs.items == ["Alice", "Bob Vance", "Carl"]


def test_relation_observation_exact():
    obs = run(name="get_tail_relations", entity="m.bob")
    assert obs.text == '["people.person.date_of_birth", "people.person.place_of_birth"]'
    assert obs.items == ["people.person.date_of_birth", "people.person.place_of_birth"]
    obs = run(name="get_head_relations", entity="m.bob")
    assert obs.items == ["film.film.directed_by", "film.performance.actor"]


def test_cap_counts_what_was_left_out():
    obs = run(KGEnvConfig(max_items=2), name="get_head_entities", entity="m.paris", relation="people.person.place_of_birth")
    assert obs.text == '["Alice (m.alice)", "Bob Vance (m.bob)"] (1 more not shown)'  # 3 found - 2 shown = 1
    assert obs.items == ["Alice", "Bob Vance"]


def test_name_and_id_form_is_accepted_name_alone_is_not():
    assert run(entity="Bob Vance (m.bob)", relation="people.person.place_of_birth").items == ["Paris"]
    obs = run(entity="Bob Vance", relation="people.person.place_of_birth")
    assert (obs.text, obs.ok, obs.error) == ("[]", False, "unknown_entity")
    obs = run(KGEnvConfig(accept_names=True), entity="Bob Vance", relation="people.person.place_of_birth")
    assert obs.ok and obs.items == ["Paris"]


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"entity": "m.nope", "relation": "film.film.directed_by"}, "unknown_entity", 'ERROR: unknown entity "m.nope"'),
        ({"entity": "m.film", "relation": "film.film.nope"}, "unknown_relation", 'ERROR: unknown relation "film.film.nope"'),
        ({"entity": "m.paris", "relation": "film.film.directed_by"}, "no_result",
         'ERROR: get_tail_entities: nothing matches ("m.paris", "film.film.directed_by")'),
        ({"entity": "m.film"}, "bad_arguments", "ERROR: get_tail_entities takes (entity, relation), got (\"entity\")"),
        ({"entity": "m.film", "relation": "x", "extra": "y"}, "bad_arguments",
         'ERROR: get_tail_entities takes (entity, relation), got ("entity", "extra", "relation")'),
        ({"entity": 5, "relation": "film.film.directed_by"}, "bad_arguments", "ERROR: get_tail_entities: entity must be a string"),
    ],
)
def test_failures_silent_by_default_informative_when_asked(arguments, error, message):
    silent = run(**arguments)
    assert (silent.text, silent.ok, silent.error, silent.items) == ("[]", False, error, [])
    loud = run(KGEnvConfig(informative_errors=True), **arguments)
    assert (loud.text, loud.ok, loud.error) == (message, False, error)


def test_malformed_calls_become_observations():
    episode = KGEnv(STORE, KGEnvConfig(informative_errors=True)).start(TASK)
    for kind in ("bad_json", "bad_call", "unclosed_tag", "too_long"):
        obs = episode.execute(ToolCall(name="", arguments={}, raw="{", error=kind))
        assert (obs.text, obs.ok, obs.error) == (f"ERROR: malformed tool call ({kind})", False, kind)
    obs = episode.execute(ToolCall(name="search", arguments={"query": "x"}))
    assert obs.error == "unknown_tool" and obs.text.startswith('ERROR: unknown tool "search"')
    silent = KGEnv(STORE).start(TASK).execute(ToolCall(name="", arguments={}, error="bad_json"))
    assert (silent.text, silent.error) == ("[]", "bad_json")


def test_system_prompt_and_user_message():
    env = KGEnv(STORE)
    prompt = env.system_prompt(TASK)
    assert "<answer>NAME</answer>" in prompt and "<tool_call>" not in prompt  # the tools block says how to call
    assert "Relations: film.film.directed_by, film.film.starring, film.performance.actor, people.person.date_of_birth, people.person.place_of_birth" in prompt
    assert len(prompt) < 700  # ~75 tokens of instructions + ~60 for this 5-relation list
    assert "Relations" not in KGEnv(STORE, KGEnvConfig(list_relations=False)).system_prompt(TASK)
    assert env.user_message(TASK) == "Where was the director of Heat born?\nTopic entity: Heat (m.film)"
    assert KGEnv(STORE, KGEnvConfig(readable_ids=True)).user_message(TASK).endswith("Topic entity: Heat")
    assert env.start(TASK).next_user_message() is None


def test_readable_ids_show_and_accept_names():
    config = KGEnvConfig(readable_ids=True)
    obs = run(config, name="get_head_entities", entity="Paris", relation="people.person.place_of_birth")
    assert obs.text == '["Alice", "Bob Vance", "Carl"]'
    assert run(config, entity="m.film", relation="film.film.starring").text == '["m.perf0", "m.perf1"]'  # nameless: ids
    gold = KGEnv(STORE, config).translate_gold(TASK)
    assert gold.gold_turns[1][0]["arguments"]["entity"] == "Bob Vance"
    assert gold.meta["plan"]["paths"][0]["start"] == ["Heat"]
    assert TASK.gold_turns[1][0]["arguments"]["entity"] == "m.bob"  # the original is untouched


def test_rename_schema_everywhere():
    config = KGEnvConfig(rename_schema=True)
    env = KGEnv(STORE, config)
    shown = env.show_relation("film.film.directed_by")
    assert re.fullmatch(r"r\.[a-z0-9]{4}\.[a-z0-9]\d\d", shown)
    assert shown == KGEnv(STORE, KGEnvConfig(rename_schema=True)).show_relation("film.film.directed_by")  # deterministic
    assert shown != KGEnv(STORE, KGEnvConfig(rename_schema=True, rename_salt="other")).show_relation("film.film.directed_by")
    assert len({env.show_relation(r) for r in STORE.relations()}) == len(STORE.relations())  # one-to-one
    prompt = env.system_prompt(TASK)
    assert shown in prompt and "film.film" not in prompt
    ep = env.start(TASK)
    assert ep.execute(ToolCall("get_tail_entities", {"entity": "m.film", "relation": shown})).items == ["Bob Vance"]
    assert ep.execute(ToolCall("get_tail_entities", {"entity": "m.film", "relation": "film.film.directed_by"})).error == "unknown_relation"
    # sorted by the shown names: the original order would leak which opaque name is which
    assert ep.execute(ToolCall("get_tail_relations", {"entity": "m.film"})).items == sorted([shown, env.show_relation("film.film.starring")])
    gold = env.translate_gold(TASK)
    assert gold.gold_turns[0][0]["arguments"]["relation"] == shown
    assert gold.gold_triples[0] == ("m.film", shown, "m.bob")
    assert gold.meta["plan"]["paths"][0]["hops"][0]["relation"] == shown
    assert opaque_relation_name("a.b.c") == opaque_relation_name("a.b.c") != opaque_relation_name("a.b.c", attempt=1)


def test_oracle_relation_hints_follow_the_gold_path():
    env = KGEnv(STORE, KGEnvConfig(oracle_relations=True))
    assert env.user_message(TASK).endswith("Hint: next use get_tail_entities with film.film.directed_by.")
    ep = env.start(TASK)
    wrong = ep.execute(ToolCall("get_tail_relations", {"entity": "m.film"}))
    assert wrong.text.endswith("\nHint: next use get_tail_entities with film.film.directed_by.")
    first = ep.execute(ToolCall("get_tail_entities", {"entity": "m.film", "relation": "film.film.directed_by"}))
    assert first.text == '["Bob Vance (m.bob)"]\nHint: next use get_tail_entities with people.person.place_of_birth.'
    last = ep.execute(ToolCall("get_tail_entities", {"entity": "m.bob", "relation": "people.person.place_of_birth"}))
    assert last.text == '["Paris (m.paris)"]'  # the path is done: no more hints
    # What rewards read is the tool's own output, without the hint.
    assert (wrong.result, first.result, last.result) == ('["film.film.directed_by", "film.film.starring"]', '["Bob Vance (m.bob)"]', None)
    assert last.result_text == last.text
    failed = env.start(TASK).execute(ToolCall("get_tail_entities", {"entity": "m.nope", "relation": "film.film.directed_by"}))
    assert (failed.text, failed.result, failed.result_text) == ("[]\nHint: next use get_tail_entities with film.film.directed_by.", "[]", "[]")
    assert run(entity="m.film", relation="film.film.directed_by").result is None  # no ablation, nothing added


def test_observations_record_the_call_as_executed():
    directed = ("get_tail_entities", "m.film", "film.film.directed_by")
    assert run(entity="m.film", relation="film.film.directed_by").resolved == directed
    assert run(entity=" m.film ", relation=" film.film.directed_by ").resolved == directed
    assert run(entity="Heat (m.film)", relation="film.film.directed_by").resolved == directed
    assert run(KGEnvConfig(accept_names=True), entity="Heat", relation="film.film.directed_by").resolved == directed
    assert run(name="get_tail_relations", entity="Bob Vance (m.bob)").resolved == ("get_tail_relations", "m.bob", "")
    env = KGEnv(STORE, KGEnvConfig(rename_schema=True))
    shown = env.show_relation("film.film.directed_by")
    assert env.start(TASK).execute(ToolCall("get_tail_entities", {"entity": "m.film", "relation": shown})).resolved == directed  # the store's name
    # Executed and found nothing: resolved; never executed: None.
    assert run(entity="m.paris", relation="film.film.directed_by").resolved == ("get_tail_entities", "m.paris", "film.film.directed_by")
    assert run(entity="m.nope", relation="film.film.directed_by").resolved is None
    assert run(entity="m.film", relation="film.film.nope").resolved is None


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="max_items"):
        KGEnv(STORE, KGEnvConfig(max_items=0))


def test_split_display():
    assert split_display("Bob Vance (m.bob)") == ("Bob Vance", "m.bob")
    assert split_display("Alice (film) (m.0x)") == ("Alice (film)", "m.0x")
    assert split_display("m.bob") is None
    assert split_display("(m.bob)") is None
    assert split_display("x (a(b))") is None


def test_process_turn_with_garbage_never_raises():
    ep = KGEnv(STORE).start(TASK)
    text = '<tool_call>{"name": "get_tail_entities", "arguments": {"entity": ["m.film"]}}</tool_call><tool_call>{oops</tool_call><tool_call>'
    outcome = process_turn(ep, text, 0)
    assert [s.observation.error for s in outcome.steps] == ["bad_arguments", "bad_json", "unclosed_tag"]
    assert outcome.results == ["[]", "[]", "[]"]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40)
    | st.sampled_from(["m.film", "m.bob", "Bob Vance", "Bob Vance (m.bob)", "film.film.directed_by", " m.film ", "1950", "r.xxxx.x00"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)
_names = st.sampled_from(["get_tail_relations", "get_head_relations", "get_tail_entities", "get_head_entities"]) | st.text(max_size=20)
_keys = st.sampled_from(["entity", "relation", "extra", ""]) | st.text(max_size=6)
_configs = st.builds(
    KGEnvConfig,
    max_items=st.integers(1, 5),
    list_relations=st.booleans(),
    informative_errors=st.booleans(),
    readable_ids=st.booleans(),
    accept_names=st.booleans(),
    rename_schema=st.booleans(),
    oracle_relations=st.booleans(),
)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=_configs,
    name=_names,
    arguments=st.dictionaries(_keys, _json_values, max_size=4),
    error=st.none() | st.sampled_from(["bad_json", "bad_call", "unclosed_tag", "too_long"]),
)
def test_fuzz_tool_calls_never_raise(config, name, arguments, error):
    env = KGEnv(STORE, config)
    obs = env.start(TASK).execute(ToolCall(name=name, arguments=arguments, raw="", error=error))
    assert isinstance(obs, Observation) and isinstance(obs.text, str)
    assert obs.error != "backend_error"  # the env's own catch-all must never be what saved it
    if not obs.ok:
        assert obs.error
        assert is_empty_observation(obs.result_text)  # whatever the switches, a failure is empty to the rewards
        first_line = obs.text.split("\n")[0]
        assert first_line == "[]" or (config.informative_errors and first_line.startswith("ERROR: ") and len(first_line) < 300)
    else:
        shown = re.sub(r" \(\d+ more not shown\)$", "", obs.text.split("\n")[0])
        assert all(isinstance(x, str) for x in json.loads(shown))
    if error is not None:
        assert obs.error == error


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300) | st.builds(lambda a, b: f"<tool_call>{a}</tool_call>{b}", st.text(max_size=120), st.text(max_size=40)))
def test_fuzz_assistant_text_never_raises(text):
    ep = KGEnv(STORE, KGEnvConfig(informative_errors=True)).start(TASK)
    outcome = process_turn(ep, text, 0)
    for step in outcome.steps:
        assert step.observation.ok or step.observation.error


def test_a_store_exception_becomes_an_observation():
    class Broken(MemoryStore):
        def tail_entities(self, entity, relation):
            raise ConnectionError("endpoint down")

    broken = Broken.from_triples(TRIPLES, NAMES)
    obs = KGEnv(broken).start(TASK).execute(ToolCall("get_tail_entities", {"entity": "m.film", "relation": "film.film.directed_by"}))
    assert (obs.text, obs.ok, obs.error) == ("[]", False, "backend_error")


def test_parse_tool_calls_round_trip_through_env():
    text = '<tool_call>\n{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}\n</tool_call>'
    (call,) = parse_tool_calls(text)
    assert KGEnv(STORE).start(TASK).execute(call).items == ["Bob Vance"]


def test_plan_opens_the_gold_trajectory_and_replays():
    env = KGEnv(STORE, KGEnvConfig(plan=True))
    assert env.system_prompt(TASK).splitlines()[4] == "Before your first call, plan the calls (verb and relation, in order) in <think></think>."
    assert "<think>" not in KGEnv(STORE).system_prompt(TASK)
    planned = env.with_plan(TASK)
    texts = planned.meta["gold_texts"]
    assert texts[0] == ("<think>get_tail_entities film.film.directed_by, get_tail_entities people.person.place_of_birth</think>\n"
                        '<tool_call>\n{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}\n</tool_call>')
    assert texts[1].startswith("<tool_call>") and texts[2] == "<answer>Paris</answer>" and len(texts) == 3
    assert "gold_texts" not in TASK.meta  # a copy; the task itself is unchanged
    assert env.with_plan(planned) is planned  # texts of its own are kept
    # The plan is text around the call: the gold turn still parses to its one call and succeeds.
    ep = env.start(planned)
    outcome = process_turn(ep, texts[0], 0)
    assert [s.call.name for s in outcome.steps] == ["get_tail_entities"] and outcome.steps[0].observation.text == '["Bob Vance (m.bob)"]'
