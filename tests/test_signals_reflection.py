"""PRS: the rule analyzer names the right turn and cause on hand-made failing KG and BFCL
episodes; the LLM analyzer over a loopback chat-completions server; reflection examples."""

from __future__ import annotations

import json

import pytest
import torch

from keel.endpoint import EndpointError
from keel.episode import run_text_episode
from keel.fc.bfcl import BfclEnv, load_bfcl_multi_turn
from keel.fc.learnable import LearnableEnv, generate_tasks
from keel.fc.policies import DONE_TEXT, make_oracle, run_fc_episode
from keel.rollout import SamplingParams, rollout
from keel.signals.reflection import LLMAnalyzer, RuleAnalyzer, collect_reflections, reflection_example, reflection_trajectory
from keel.sft import collate_sft
from keel.types import Source, Trajectory
from test_endpoint import LoopbackServer
from test_signals_ops import KG_ENV, kg_task


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


FILM = call("get_tail_entities", entity="m.film", relation="film.film.directed_by")
BIRTH = call("get_tail_entities", entity="m.bob", relation="people.person.place_of_birth")


def kg_episode(*texts: str, max_turns: int = 6) -> Trajectory:
    script = list(texts)
    return run_text_episode(KG_ENV, kg_task(), lambda task, messages: script.pop(0), max_turns).to_trajectory()


def test_kg_wrong_relation_exact_reflection():
    traj = kg_episode(FILM, call("get_tail_entities", entity="m.bob", relation="film.film.starring"), "<answer>Rome</answer>")
    r = RuleAnalyzer(KG_ENV).analyze(traj, kg_task())
    assert (r.turn, r.cause) == (1, "wrong_relation")
    assert r.text == (
        "Turn 2 went wrong: wrong relation. get_tail_entities(m.bob, film.film.starring) returned nothing; "
        "from m.bob the gold path follows people.person.place_of_birth.\n"
        "Corrected calls:\n"
        'Turn 1: {"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}\n'
        'Turn 2: {"name": "get_tail_entities", "arguments": {"entity": "m.bob", "relation": "people.person.place_of_birth"}}\n'
        "Answer: Paris"
    )
    assert "<tool_call>" not in r.text  # corrections do not train control tags


@pytest.mark.parametrize(
    "texts, turn, cause, detail",
    [
        # the relation of hop 1 on the wrong entity: m.alice is not on the gold path
        ((call("get_tail_entities", entity="m.alice", relation="film.film.directed_by"), "<answer>x</answer>"), 0, "wrong_entity", "the gold call uses m.film"),
        (("<tool_call>\n{bad json\n</tool_call>", "<answer>x</answer>"), 0, "format_error", "could not be parsed (bad_json)"),
        ((FILM, call("get_tail_entities", entity="m.bob"), "<answer>x</answer>"), 1, "missing_parameter", "get_tail_entities was called without relation."),
        ((call("find_entities", entity="m.film"), "<answer>x</answer>"), 0, "unknown_function", "'find_entities' is not a tool"),
        ((call("get_head_entities", entity="m.film", relation="film.film.directed_by"), "<answer>x</answer>"), 0, "wrong_function", "the gold call is get_tail_entities"),
        # every call works, but hop 2 starts from Alice (a starring actor), not from the director:
        # no single call fails, classify_failure calls it composition
        ((FILM, call("get_tail_entities", entity="m.alice", relation="people.person.place_of_birth"), "<answer>Rome</answer>"), 1, "wrong_entity",
         "followed people.person.place_of_birth from m.alice; the gold path follows it from m.bob"),
        ((FILM, BIRTH, "<answer>Bob Vance</answer>"), 2, "wrong_answer", "It answered Bob Vance; the answer is Paris."),
        (("<answer>Paris, maybe Rome</answer>",), 0, "missing_call", "answered without calling any tool"),
        ((FILM, FILM), 1, "no_answer", "truncated after 2 turns"),
    ],
)
def test_kg_rule_analyzer_names_turn_and_cause(texts, turn, cause, detail):
    traj = kg_episode(*texts, max_turns=len(texts))
    r = RuleAnalyzer(KG_ENV).analyze(traj, kg_task())
    assert (r.turn, r.cause) == (turn, cause), r.text
    assert detail in r.detail and r.text.startswith(f"Turn {turn + 1} went wrong:")


def test_kg_success_and_broken_gold_give_no_reflection():
    assert RuleAnalyzer(KG_ENV).analyze(kg_episode(FILM, BIRTH, "<answer>Paris</answer>"), kg_task()) is None
    broken = kg_task("film.film.no_such_relation")
    assert RuleAnalyzer(KG_ENV).analyze(kg_episode("<answer>x</answer>"), broken) is None


def fc_episode(env, task, texts, max_turns: int = 12) -> Trajectory:
    script = list(texts)
    ep, info = run_fc_episode(env, task, lambda t, m: script.pop(0) if script else DONE_TEXT, max_turns)
    traj = ep.to_trajectory()
    traj.info.update(info)
    return traj


MATH = generate_tasks(1, seed=0)[0]  # user turn 1: add(a=51, b=99); user turn 2: multiply(a=150, b=8)


@pytest.mark.parametrize(
    "texts, turn, cause, detail",
    [
        ([call("add", a=51, b=98)], 0, "wrong_arguments", 'add got b=98; the correct call is {"name": "add", "arguments": {"a": 51, "b": 99}}.'),
        ([call("add", a=51)], 0, "missing_parameter", "add was called without b"),
        ([call("subtract", a=51, b=99)], 0, "wrong_function", "It called subtract; the correct call is"),
        # power is a MathAPI method (it would run) but this task does not offer it; integrate does not exist
        ([call("power", base=2, exponent=3)], 0, "unknown_function", "'power' is not one of the offered functions (add, multiply, subtract)."),
        ([call("integrate", f="x")], 0, "unknown_function", "'integrate' is not one of the offered functions"),
        (["<tool_call>\n{oops\n</tool_call>"], 0, "format_error", "(bad_json)"),
        # user turn 2 closed without its call (assistant turns: add, done, done)
        ([call("add", a=51, b=99), DONE_TEXT, DONE_TEXT], 2, "missing_call", 'User turn 2 ended without {"name": "multiply"'),
        # an extra harmless call is reported only when nothing worse happened: here the miss is worse
        ([call("add", a=51, b=99) + "\n" + call("add", a=1, b=1), DONE_TEXT, DONE_TEXT], 2, "missing_call", "User turn 2 ended without"),
    ],
)
def test_function_calling_rule_analyzer(texts, turn, cause, detail):
    env = LearnableEnv()
    traj = fc_episode(env, MATH, texts)
    assert traj.info["checker_valid"] is False
    r = RuleAnalyzer(env).analyze(traj, MATH)
    assert (r.turn, r.cause) == (turn, cause), r.text
    assert detail in r.detail
    assert r.text.endswith(
        'User turn 1: {"name": "add", "arguments": {"a": 51, "b": 99}}\nUser turn 2: {"name": "multiply", "arguments": {"a": 150, "b": 8}}'
    )


def test_function_calling_success_gives_none():
    env = LearnableEnv()
    traj = fc_episode(env, MATH, [call("add", a=51, b=99), DONE_TEXT, call("multiply", a=150, b=8), DONE_TEXT])
    assert traj.info["checker_valid"] is True and RuleAnalyzer(env).analyze(traj, MATH) is None


def test_real_bfcl_entry_wrong_argument_in_third_assistant_turn():
    env = BfclEnv("json")
    task = load_bfcl_multi_turn("base", ids=["multi_turn_base_0"])[0]
    oracle = make_oracle("json")

    def policy(t, messages):  # the oracle, except grep searches for "quarterly" instead of "budget analysis"
        return oracle(t, messages).replace('"budget analysis"', '"quarterly"')

    ep, info = run_fc_episode(env, task, policy, 40)
    traj = ep.to_trajectory()
    traj.info.update(info)
    assert info["checker_valid"] is False
    r = RuleAnalyzer(env).analyze(traj, task)
    # assistant turns: 0 = user turn 1's calls, 1 = its closing text, 2 = cd + grep
    assert (r.turn, r.cause) == (2, "wrong_arguments")
    assert r.detail == 'grep got pattern="quarterly"; the correct call is {"name": "grep", "arguments": {"file_name": "final_report.pdf", "pattern": "budget analysis"}}.'
    assert r.text.count("User turn") == 4


def test_llm_analyzer_over_loopback_server():
    traj = kg_episode(FILM, call("get_tail_entities", entity="m.bob", relation="film.film.starring"), "<answer>Rome</answer>")
    reply = "Turn 2 went wrong: wrong relation. It asked m.bob for film.film.starring.\nCorrected calls:\nTurn 1: ...\nTurn 2: ..."
    with LoopbackServer([reply, "I am not sure.", "   "]) as server:
        analyzer = LLMAnalyzer(server.base_url, "judge", api_key="k")
        r = analyzer.analyze(traj, kg_task())
        assert (r.turn, r.cause, r.detail, r.text) == (1, "wrong_relation", "It asked m.bob for film.film.starring.", reply)
        body = server.requests[0]["body"]
        assert body["model"] == "judge" and body["temperature"] == 0.0
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        assert "Turn N went wrong: CAUSE." in system and "wrong relation" in system
        assert user.startswith("Question: Where was the director of Heat born?")
        assert '"relation": "film.film.starring"' in user and "Final answer: Rome" in user
        assert user.endswith('"relation": "people.person.place_of_birth"}}\nAnswer: Paris')
        loose = analyzer.analyze(traj, kg_task())
        assert (loose.turn, loose.cause, loose.text) == (-1, "unparsed", "I am not sure.")
        with pytest.raises(EndpointError, match="empty reflection"):
            analyzer.analyze(traj, kg_task())
    assert analyzer.analyze(kg_episode(FILM, BIRTH, "<answer>Paris</answer>"), kg_task()) is None  # success: no request
    with pytest.raises(EndpointError, match="not an http"):
        LLMAnalyzer("localhost:8000", "m")


def test_collect_reflections_counts_endpoint_failures():
    bad = kg_episode(FILM, call("get_tail_entities", entity="m.bob", relation="film.film.starring"), "<answer>Rome</answer>")
    good = kg_episode(FILM, BIRTH, "<answer>Paris</answer>")
    bad.reward, good.reward = 0.0, 1.0
    reply = "Turn 2 went wrong: wrong relation. x"
    with LoopbackServer([(503, "overloaded"), reply]) as server:
        got, errors = collect_reflections(LLMAnalyzer(server.base_url, "m"), [bad, good, bad], {"t0": kg_task()})
    assert errors == 1 and len(got) == 1 and got[0][1].cause == "wrong_relation" and len(server.requests) == 2
    got, errors = collect_reflections(RuleAnalyzer(KG_ENV), [bad, good, bad], {"t0": kg_task()}, max_count=1)
    assert errors == 0 and len(got) == 1
    with pytest.raises(ValueError, match="task 't0' has no task among the 0 given"):
        collect_reflections(RuleAnalyzer(KG_ENV), [bad], {})


def test_reflection_example_targets_only_the_reflection(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.0, max_turns=1, max_new_tokens=5, max_total_tokens=4096)
    traj = rollout(model, tok, KG_ENV, [kg_task()], params, generator=torch.Generator().manual_seed(0), hints=["Hint: try m.film."])[0]
    assert traj.truncated and traj.token_ids[-1] != tok.convert_tokens_to_ids("<|im_end|>")  # 5 tokens, cut mid-turn
    text = "Turn 1 went wrong: no answer. It never called a tool."
    tr = reflection_trajectory(tok, traj, text)
    n_hint = sum(s == Source.HINT for s in traj.sources)
    base = len(traj.token_ids) - n_hint
    assert Source.HINT not in tr.sources
    assert tr.token_ids[: base] == [t for t, s in zip(traj.token_ids, traj.sources) if s != Source.HINT]
    a, b = tr.turn_spans[0]
    assert tok.decode(tr.token_ids[base:a]) == "<|im_end|>\n<|im_start|>user\nReview the episode above: say which turn went wrong and why, then give the corrected calls.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tr.token_ids[a:b]) == text + "<|im_end|>" and b == len(tr.token_ids)
    ex = reflection_example(tok, traj, text)
    assert ex.token_ids == tr.token_ids and [i for i, t in enumerate(ex.targets) if t] == list(range(a, b))
    assert all(s == Source.REFLECTION for s in tr.sources[a:b]) and sum(s == Source.REFLECTION for s in tr.sources) == b - a
    ids, attn, tmask = collate_sft([ex], tok.pad_token_id)
    assert int(tmask.sum()) == b - a
    assert reflection_example(tok, traj, text, max_tokens=len(tr.token_ids) - 1) is None
    with pytest.raises(ValueError, match="empty reflection text"):
        reflection_example(tok, traj, "  ")
    with pytest.raises(ValueError, match="has no tokens"):
        reflection_example(tok, kg_episode("<answer>x</answer>"), text)
