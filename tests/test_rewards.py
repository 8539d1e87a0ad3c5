"""Paper B's reward ladder and paper A's function-calling rewards, with hand-computed values."""

from __future__ import annotations

import json

import pytest

from keel.chat import extract_answer
from keel.diagnostics.classify import is_quote_and_stop
from keel.diagnostics.episode_metrics import episode_record
from keel.kg.env import KGEnv, KGEnvConfig
from keel.kg.store import MemoryStore
from keel.rewards import (
    REWARDS,
    distinct_nonempty_calls,
    fc_binary,
    fc_tag_balance,
    is_empty_observation,
    observation_words,
    r_binary,
    r_binary_sr,
    r_selfv,
    r_selfv_gated,
    r_selfv_no_retrv,
    r_stepwise,
    r_toolverbs,
    returned_entities,
    stepwise_step_scores,
)
from keel.types import Observation, Step, Task, ToolCall, Trajectory

SPOUSE = "people.person.spouse_s"
BIRTH = "people.person.place_of_birth"

TASK = Task(
    id="q1",
    question="Where was the spouse of X born?",
    answers=["Honolulu"],
    aliases=["Honolulu, Hawaii"],
    answer_ids=["m.hon"],
    topic_entities={"m.x": "X Person"},
    gold_triples=[("m.x", SPOUSE, "m.s"), ("m.s", BIRTH, "m.hon")],
)


def step(verb: str, obs: str, turn: int = 0, **args) -> Step:
    return Step(turn=turn, call=ToolCall(name=verb, arguments=args), observation=Observation(text=obs, ok=obs not in ("[]", "")))


def traj(steps: list[Step], answer: str | None, texts: list[str] | None = None, **info) -> Trajectory:
    return Trajectory(task_id="q1", token_ids=[], sources=[], logprobs=[], turn_texts=texts or [], steps=steps, answer=answer, info=info)


SPOUSE_CALL = dict(entity="m.x", relation=SPOUSE)
GOLD_PATH = traj(
    [
        step("get_tail_entities", '["Michelle Obama (m.s)"]', 0, **SPOUSE_CALL),
        step("get_tail_entities", '["Honolulu (m.hon)"]', 1, entity="m.s", relation=BIRTH),
    ],
    "Honolulu",
)
# Mode 4: one call, copy the first returned entity, stop.
QUOTE_AND_STOP = traj([step("get_tail_entities", '["Michelle Obama (m.s)"]', 0, **SPOUSE_CALL)], "Michelle Obama")
# Mode 2: always get_tail_relations on the topic entity, then answer from memory.
RITUAL = traj([step("get_tail_relations", f'["{SPOUSE}", "{BIRTH}"]', 0, entity="m.x")], "Honolulu")


def test_empty_rule_and_entity_reading():
    assert [is_empty_observation(t) for t in ["", "  ", "[]", "No results found", "ERROR: unknown entity m.q", "[ ]"]] == [
        True, True, True, True, True, False,  # "[ ]" is not exactly "[]": the authors' rule, kept
    ]
    assert returned_entities('["Barack Obama (m.02mjmr)", "Honolulu (m.03h64)"]') == ["Barack Obama", "Honolulu"]
    # A comma inside a name splits it, as in the authors' code.
    assert returned_entities('["Washington, D.C. (m.0rh6k)"]') == ["Washington", "D.C."]
    assert returned_entities("[]") == [] and returned_entities("ERROR: x") == []
    assert returned_entities(f'["{SPOUSE}"]') == [SPOUSE]
    assert observation_words('["Barack Obama (m.02mjmr)"]') == {"barack", "obama", "barack obama", "m.02mjmr"}


def test_a_list_cut_at_max_items_reads_its_shown_entries():
    # keel.kg.env writes '(N more not shown)' after a list longer than env.max_items; the last
    # shown entry was read as 'Honolulu (m.03h64)"] (12 more not shown)' and never matched.
    cut = '["Barack Obama (m.02mjmr)", "Honolulu (m.03h64)"] (12 more not shown)'
    assert returned_entities(cut) == ["Barack Obama", "Honolulu"]
    assert observation_words(cut) == observation_words('["Barack Obama (m.02mjmr)", "Honolulu (m.03h64)"]')


def test_r_binary_alias_and_f1():
    total, c = r_binary(traj([], "Honolulu, Hawaii"), TASK)
    # EM 1 via the alias; F1 vs "honolulu": pred [honolulu, hawaii], common 1, P 1/2, R 1 → 2/3.
    assert c["em"] == 1.0 and c["f1"] == pytest.approx(2 / 3)
    assert total == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    total_sr, c_sr = r_binary_sr(traj([], "Honolulu, Hawaii"), TASK)
    assert total_sr == 1.0 and c_sr["f1"] == pytest.approx(2 / 3)
    # Partial answer: EM 0, F1 vs "honolulu" of "honolulu city" = 2·(1/2)·1/(1/2+1) = 2/3.
    assert r_binary_sr(traj([], "Honolulu city"), TASK)[0] == 0.0
    assert r_binary(traj([], "Honolulu city"), TASK)[0] == pytest.approx(1 / 3)


def test_empty_answer_scores_zero_everywhere():
    empty = traj([], "", ["<answer></answer>"])
    never = traj([], None, ["<think>hmm"])
    for name in ("r_binary", "r_binary_sr", "r_stepwise", "r_stepwise_released", "r_toolverbs", "r_selfv", "r_selfv_gated", "r_selfv_no_retrv"):
        assert REWARDS[name](empty, TASK)[0] == 0.0, name
        assert REWARDS[name](never, TASK)[0] == 0.0, name
    # With a successful call but an empty answer, r_retrv is 0 (empty answer) and only r_tool pays.
    copy_nothing = traj([step("get_tail_entities", '["Michelle Obama (m.s)"]', **SPOUSE_CALL)], "")
    total, c = r_selfv(copy_nothing, TASK)
    assert c["r_retrv"] == 0.0 and total == pytest.approx(0.5 * 1.0)


def test_stepwise_gold_path_by_hand():
    s1, s2 = stepwise_step_scores(GOLD_PATH, TASK)
    # Gold-path entities {m.x, m.s, m.hon}. Step 1 sees only m.s: on_path min(1/3, 0.5); no answer
    # entity → progress 1/3; args share m.x with the topic → coherence 1; 24 chars → valid 1.
    assert (s1["on_path"], s1["progress"], s1["coherence"], s1["valid"]) == pytest.approx((1 / 3, 1 / 3, 1, 1))
    assert s1["step"] == pytest.approx(0.45 / 3 + 0.30 / 3 + 0.15 + 0.10)  # 0.5
    # Step 2 sees m.hon (an answer id) → progress 1; its entity m.s came from step 1's output → coherence 1.
    assert (s2["on_path"], s2["progress"], s2["coherence"], s2["valid"]) == pytest.approx((1 / 3, 1, 1, 1))
    assert s2["step"] == pytest.approx(0.45 / 3 + 0.30 + 0.15 + 0.10)  # 0.7
    total, c = r_stepwise(GOLD_PATH, TASK)
    assert c["r_step"] == pytest.approx(0.6)
    assert total == pytest.approx(0.3 * 1.0 + 0.7 * 0.6)  # 0.72


def test_stepwise_on_path_full_credit_and_no_steps():
    # An observation that names both ends of a gold triple earns on_path 1.
    both = traj([step("get_head_entities", '["X Person (m.x)", "Michelle Obama (m.s)"]', entity="m.s", relation=SPOUSE)], "")
    assert stepwise_step_scores(both, TASK)[0]["on_path"] == 1.0
    total, c = r_stepwise(traj([], "Honolulu"), TASK)
    assert c["r_step"] == 0.0 and total == pytest.approx(0.3)


def test_ritual_rewards():
    # Stepwise: on_path 0, progress 0, coherence 1 (topic entity), valid 1 → 0.25 per step.
    total, c = r_stepwise(RITUAL, TASK)
    assert c["r_step"] == pytest.approx(0.25) and total == pytest.approx(0.3 + 0.7 * 0.25)  # 0.475
    # Tool verbs: relation verb weight 0.3 → 0.3·1 + 0.7·0.3 = 0.51.
    assert r_toolverbs(RITUAL, TASK)[0] == pytest.approx(0.51)
    # Self-verifying: no returned relation is in the answer → r_retrv 0 → 0.25 + 0.5·0.3 = 0.40.
    total, c = r_selfv(RITUAL, TASK)
    assert c["r_retrv"] == 0.0 and total == pytest.approx(0.40)


def test_quote_and_stop_pays_under_selfv_and_not_under_the_gate():
    # EM 0, F1 0; r_tool 1; r_retrv 1/1 → 0.5 + 0.25 = 0.75.
    total, c = r_selfv(QUOTE_AND_STOP, TASK)
    assert (c["em"], c["r_tool"], c["r_retrv"]) == (0.0, 1.0, 1.0) and total == pytest.approx(0.75)
    total_g, c_g = r_selfv_gated(QUOTE_AND_STOP, TASK)
    assert c_g["distinct_nonempty"] == 1.0 and c_g["gate_open"] == 0.0 and c_g["r_retrv_raw"] == 1.0
    assert total_g == pytest.approx(0.5)
    assert r_selfv_no_retrv(QUOTE_AND_STOP, TASK)[0] == pytest.approx(0.5)
    # The gold path: r_out 1, r_tool 1, r_retrv 1/2 (only the second call's entity is in the answer).
    assert r_selfv(GOLD_PATH, TASK)[0] == pytest.approx(0.25 + 0.5 + 0.125)
    assert r_selfv_gated(GOLD_PATH, TASK)[0] == pytest.approx(0.875)  # 2 distinct non-empty calls: gate open
    assert r_selfv_no_retrv(GOLD_PATH, TASK)[0] == pytest.approx(0.75)


def test_call_count_inflation_does_not_pay():
    same = traj([step("get_tail_entities", '["Michelle Obama (m.s)"]', t, **SPOUSE_CALL) for t in range(5)], "Michelle Obama")
    # Five identical calls: means unchanged, one distinct signature keeps the gate shut.
    assert r_selfv(same, TASK)[0] == pytest.approx(0.75)
    assert r_selfv_gated(same, TASK)[0] == pytest.approx(0.5)
    assert r_toolverbs(same, TASK)[0] == pytest.approx(0.7)
    # Padding with three empty calls dilutes both means: r_tool = r_retrv = 1/4.
    padded = traj(QUOTE_AND_STOP.steps + [step("get_tail_entities", "[]", 1, entity="m.nope", relation=BIRTH)] * 3, "Michelle Obama")
    total, c = r_selfv(padded, TASK)
    assert (c["r_tool"], c["r_retrv"]) == (0.25, 0.25) and total == pytest.approx(0.5 * 0.25 + 0.25 * 0.25)
    # Distinct but empty calls do not open the gate either.
    assert r_selfv_gated(padded, TASK)[1]["gate_open"] == 0.0


def test_informative_error_counts_as_empty():
    err = traj([step("get_tail_entities", "ERROR: unknown entity m.q", entity="m.q", relation=SPOUSE)], "Honolulu")
    assert r_toolverbs(err, TASK)[1]["r_tool"] == 0.0


def test_tag_spam_and_fc_rewards():
    spam = ["<tool_call><tool_call><tool_call>\n</tool_call>"]
    # open 3, close 1 → |3 − 1| / 4 = 0.5.
    assert fc_tag_balance(traj([], None, spam, checker_valid=True), TASK) == (0.5, {"valid": 1.0, "tag_imbalance": 0.5})
    assert fc_tag_balance(traj([], None, spam, checker_valid=False), TASK)[0] == -0.5
    balanced = ['<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>']
    assert fc_tag_balance(traj([], None, balanced, checker_valid=True), TASK)[0] == 1.0
    assert fc_tag_balance(traj([], "done", ["done"], checker_valid=True), TASK)[0] == 1.0  # no tags, no penalty
    assert fc_binary(traj([], None, spam, checker_valid=True), TASK) == (1.0, {"valid": 1.0})
    assert fc_binary(traj([], None, spam, checker_valid=False), TASK)[0] == 0.0
    with pytest.raises(ValueError, match="checker_valid"):
        fc_binary(traj([], None, spam), TASK)
    with pytest.raises(ValueError, match="checker_valid"):
        fc_binary(traj([], None, spam, checker_valid="yes"), TASK)
    # Tag spam in KG episodes: the unclosed call fails to parse, its verb is "" → weight 0.
    bad = Step(turn=0, call=ToolCall(name="", arguments={}, error="unclosed_tag"), observation=Observation("ERROR: bad call", ok=False))
    assert r_toolverbs(traj([bad], "Honolulu"), TASK)[1]["r_tool"] == 0.0


def test_contract_every_reward_returns_float_and_components():
    for name, fn in REWARDS.items():
        t = traj(GOLD_PATH.steps, "Honolulu", ["x"], checker_valid=True)
        total, comps = fn(t, TASK)
        assert isinstance(total, float) and all(isinstance(v, float) for v in comps.values()), name


# --- what the env resolved, and what the model was shown (issue 13) -------------------------------

KG = MemoryStore.from_triples([("m.x", SPOUSE, "m.s"), ("m.s", BIRTH, "m.hon")], {"m.x": "X Person", "m.s": "Michelle Obama", "m.hon": "Honolulu"})
KG_TASK = Task(
    id="q1", question=TASK.question, answers=TASK.answers, aliases=TASK.aliases, answer_ids=TASK.answer_ids,
    topic_entities=TASK.topic_entities, gold_triples=TASK.gold_triples,
    gold_turns=[[{"name": "get_tail_entities", "arguments": SPOUSE_CALL}], [{"name": "get_tail_entities", "arguments": {"entity": "m.s", "relation": BIRTH}}]],
)


def env_steps(config: KGEnvConfig, *calls: tuple[str, dict]) -> list[Step]:
    """The calls executed in turn order by one episode of the real KG env."""
    episode = KGEnv(KG, config).start(KG_TASK)
    return [Step(turn=i, call=ToolCall(name=verb, arguments=args), observation=episode.execute(ToolCall(name=verb, arguments=args))) for i, (verb, args) in enumerate(calls)]


def test_one_call_in_several_spellings_does_not_open_the_gate():
    # "m.x", " m.x" and "X Person (m.x)" are one entity to the env, " people.person.spouse_s " one relation:
    # three spellings of the quote-and-stop call.
    spellings = [SPOUSE_CALL, {"entity": " m.x", "relation": SPOUSE}, {"entity": "X Person (m.x)", "relation": f" {SPOUSE} "}]
    steps = env_steps(KGEnvConfig(), *[("get_tail_entities", a) for a in spellings])
    assert len({s.call.signature() for s in steps}) == 3  # three raw signatures...
    quote = traj(steps, "Michelle Obama")
    total, c = r_selfv_gated(quote, KG_TASK)
    # ...one resolved call: the gate stays shut. r_tool 1, r_retrv_raw 3/3 = 1 but unpaid, r_out 0 → 0.5.
    assert (c["distinct_nonempty"], c["gate_open"], c["r_retrv_raw"]) == (1.0, 0.0, 1.0)
    assert total == pytest.approx(0.5)
    assert episode_record(quote, KG_TASK)["distinct_nonempty"] == 1
    assert [s.observation.resolved for s in steps] == [("get_tail_entities", "m.x", SPOUSE)] * 3
    # Names accepted (readable ids): "X Person" is the same call too.
    named = env_steps(KGEnvConfig(readable_ids=True), ("get_tail_entities", {"entity": "X Person", "relation": SPOUSE}), ("get_tail_entities", SPOUSE_CALL))
    assert distinct_nonempty_calls(named) == 1
    # Two different calls still open it: the gold path, r_out 1, r_tool 1, r_retrv 1/2 → 0.25 + 0.5 + 0.125.
    gold = env_steps(KGEnvConfig(), ("get_tail_entities", SPOUSE_CALL), ("get_tail_entities", {"entity": "Michelle Obama (m.s)", "relation": BIRTH}))
    total, c = r_selfv_gated(traj(gold, "Honolulu"), KG_TASK)
    assert (c["distinct_nonempty"], c["gate_open"]) == (2.0, 1.0) and total == pytest.approx(0.875)


def test_saved_trajectories_keep_and_lack_resolution():
    steps = env_steps(KGEnvConfig(), ("get_tail_entities", SPOUSE_CALL), ("get_tail_entities", {"entity": " m.x", "relation": SPOUSE}))
    saved = json.loads(json.dumps(traj(steps, "Michelle Obama").to_dict()))
    back = Trajectory.from_dict(saved)
    assert [s.observation.resolved for s in back.steps] == [("get_tail_entities", "m.x", SPOUSE)] * 2  # a tuple again, not a list
    assert distinct_nonempty_calls(back.steps) == 1
    # A file written before observations carried a resolution: it loads, and only the raw
    # arguments are there to count (two spellings → 2, the old behaviour).
    for s in saved["steps"]:
        for key in ("resolved", "result"):
            s["observation"].pop(key, None)
    old = Trajectory.from_dict(saved)
    assert [s.observation.resolved for s in old.steps] == [None, None]
    assert distinct_nonempty_calls(old.steps) == 2


def test_oracle_hint_is_not_what_rewards_read():
    failed = ("get_tail_entities", {"entity": "m.nope", "relation": SPOUSE})
    calls = (failed, ("get_tail_entities", SPOUSE_CALL), ("get_tail_entities", {"entity": "m.s", "relation": BIRTH}))
    hinted = env_steps(KGEnvConfig(oracle_relations=True), *calls)
    plain = env_steps(KGEnvConfig(), *calls)
    assert hinted[0].observation.text == f"[]\nHint: next use get_tail_entities with {SPOUSE}."  # the model still sees the hint
    assert hinted[1].observation.text == f'["Michelle Obama (m.s)"]\nHint: next use get_tail_entities with {BIRTH}.'
    # The failed call, then the quote: by hand, as without the hint, the failed call is empty
    # (weight 0, not productive, not counted by the gate).
    quote = traj(hinted[:2], "Michelle Obama")
    assert r_toolverbs(quote, KG_TASK)[1]["r_tool"] == pytest.approx(0.5)  # (0 + 1)/2
    total, c = r_selfv_gated(quote, KG_TASK)
    assert (c["r_tool"], c["r_retrv_raw"], c["distinct_nonempty"], c["gate_open"]) == (0.5, 0.5, 1.0, 0.0)
    assert total == pytest.approx(0.25)  # 0.5·0.5; the failed call neither pays nor opens the gate
    for answer in ("Michelle Obama", "Honolulu"):
        for name in ("r_stepwise", "r_stepwise_released", "r_toolverbs", "r_selfv", "r_selfv_gated", "r_selfv_no_retrv"):
            assert REWARDS[name](traj(hinted, answer), KG_TASK) == REWARDS[name](traj(plain, answer), KG_TASK), (name, answer)
    rec_h, rec_p = episode_record(traj(hinted, "Honolulu", ["<answer>Honolulu</answer>"]), KG_TASK), episode_record(traj(plain, "Honolulu", ["<answer>Honolulu</answer>"]), KG_TASK)
    assert (rec_h["empty_results"], rec_h["distinct_nonempty"], rec_h["cvt"]) == (1, 2, 1.0) and rec_h == rec_p
    assert is_quote_and_stop(traj(hinted[1:2], "Michelle Obama"))
    # The tool's own result, entity by entity, is the same with the ablation on and off.
    assert [s.observation.result_text for s in hinted] == [s.observation.text for s in plain]
    assert [returned_entities(s.observation.result_text) for s in hinted] == [[], ["Michelle Obama"], ["Honolulu"]]
    assert is_empty_observation(hinted[0].observation.result_text) and not is_empty_observation(hinted[0].observation.text)


# --- R-stepwise as released ------------------------------------------------------------------------


def test_stepwise_released_rule_by_hand():
    released = REWARDS["r_stepwise_released"]
    # Gold-path entities {m.x, m.s, m.hon}; answer entities {m.hon, honolulu, honolulu, hawaii}.
    # Step 1 '["Michelle Obama (m.s)"]': no triple has both ends in the text; its whitespace words
    # '["michelle', 'obama', '(m.s)"]' hold no path id → on_path 0; normalised words {michelle, obama,
    # m, s} hold no answer and no path id → progress 0; args share m.x with the topic → coherence 1;
    # valid 1 → 0.25.
    # Step 2 '["Honolulu (m.hon)"]': on_path 0 as before; normalised words hold "honolulu" → progress 1;
    # the previous words were split on "." ({m, s}), so the argument m.s is not among them → coherence 0;
    # valid 1 → 0.40.
    total, c = released(GOLD_PATH, TASK)
    assert (c["on_path"], c["progress"], c["coherence"], c["valid"]) == pytest.approx((0, 0.5, 0.5, 1))
    assert c["r_step"] == pytest.approx((0.25 + 0.40) / 2)  # 0.325, Keel's rule: 0.6
    assert total == pytest.approx(0.3 * 1.0 + 0.7 * 0.325)  # 0.5275
    # Both ends of a gold triple in the text: on_path 1 under both rules.
    both = traj([step("get_head_entities", '["X Person (m.x)", "Michelle Obama (m.s)"]', entity="m.s", relation=SPOUSE)], "")
    assert released(both, TASK)[1]["on_path"] == 1.0
    # The ritual scores the same under both rules: 0.25 per step.
    assert released(RITUAL, TASK) == r_stepwise(RITUAL, TASK)
    assert released(traj([], "Honolulu"), TASK)[0] == pytest.approx(0.3)


def test_answer_is_the_first_answer_tag():
    # The released reader: the first <answer>…</answer>; else the text after the last </think>; else all.
    assert extract_answer("<answer>Paris</answer> no, <answer>Rome</answer>") == "Paris"
    assert extract_answer("<think>a</think><think>b</think> Rome ") == "Rome"
    assert extract_answer(" Rome ") == "Rome"
