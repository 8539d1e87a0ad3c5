"""ReST-EM self-distillation: the keep rule, relabelled targets, and the file between runs."""

from __future__ import annotations

import pytest
import torch

from keel.rollout import SamplingParams, rollout
from keel.signals.ops import gold_steer
from keel.signals.restem import read_trajectories, rejection_counts, select, self_distillation_examples, why_rejected, write_trajectories
from keel.types import Source
from test_signals_ops import KG_ENV, kg_task
from test_signals_reflection import BIRTH, FILM, MATH, call, fc_episode, kg_episode


def test_keep_rule_kg():
    task = kg_task()
    kept = kg_episode(FILM, BIRTH, "<answer>Paris</answer>")
    cases = {
        "kept": kept,
        "not_correct": kg_episode(FILM, BIRTH, "<answer>Rome</answer>"),
        # right answer from memory: no call at all, or only calls that returned nothing
        "no_call": kg_episode("<answer>Paris</answer>"),
        "empty_calls": kg_episode(call("get_tail_entities", entity="m.paris", relation="film.film.starring"), "<answer>Paris</answer>"),
        # right answer, a successful call, but one call did not parse / no <answer> tag
        "bad_call": kg_episode("<tool_call>{x</tool_call>", FILM, BIRTH, "<answer>Paris</answer>"),
        "no_tag": kg_episode(FILM, BIRTH, "Paris"),
    }
    reasons = {k: why_rejected(t, task) for k, t in cases.items()}
    assert reasons == {"kept": None, "not_correct": "not_correct", "no_call": "no_successful_call", "empty_calls": "no_successful_call",
                       "bad_call": "invalid_format", "no_tag": "invalid_format"}
    trajs = list(cases.values()) + [kg_episode(FILM, BIRTH, "<answer>Paris</answer>")]  # a duplicate of the kept one
    assert select(trajs, [task]) == [kept]
    assert rejection_counts(trajs, [task]) == {"kept": 2, "not_correct": 1, "no_successful_call": 2, "invalid_format": 2}
    with pytest.raises(ValueError, match="task 't0' has no task among the 0 given"):
        select(trajs, [])


def test_keep_rule_function_calling_uses_the_checker():
    from keel.fc.learnable import LearnableEnv
    from keel.fc.policies import DONE_TEXT

    env = LearnableEnv()
    good = fc_episode(env, MATH, [call("add", a=51, b=99), DONE_TEXT, call("multiply", a=150, b=8), DONE_TEXT])
    bad = fc_episode(env, MATH, [call("add", a=51, b=98), DONE_TEXT, call("multiply", a=149, b=8), DONE_TEXT])
    assert (why_rejected(good, MATH), why_rejected(bad, MATH)) == (None, "not_correct")
    assert select([bad, good], {MATH.id: MATH}) == [good]


def test_max_per_task():
    task = kg_task()
    a = kg_episode(FILM, BIRTH, "<answer>Paris</answer>")
    b = kg_episode(FILM, BIRTH, "<answer>paris</answer>")  # another correct episode (different text)
    assert select([a, b], [task]) == [a, b]
    assert select([a, b], [task], max_per_task=1) == [a]


def test_self_distillation_targets_are_the_episode_own_tokens(tiny):
    model, tok = tiny
    task = kg_task()
    params = SamplingParams(temperature=1.0, max_turns=4, max_new_tokens=64, max_total_tokens=4096)
    # a "checkpoint" that solves the task: every turn steered to the gold turn, with a sampling-only hint
    trajs = rollout(model, tok, KG_ENV, [task, task], params, generator=torch.Generator().manual_seed(0),
                    hints=["Hint: start at m.film.", None], steer=gold_steer(tok, KG_ENV, [task, task], [0]))
    kept = select(trajs, [task])
    assert kept == [trajs[0]] and Source.HINT in kept[0].sources
    examples = self_distillation_examples(kept, packed=False)
    n_hint = sum(s == Source.HINT for s in kept[0].sources)
    assert len(examples) == 3
    for e, (a, b) in zip(examples, kept[0].turn_spans):
        assert [i for i, t in enumerate(e.targets) if t] == list(range(a - n_hint, b - n_hint))
        assert e.token_ids == [t for t, s in zip(kept[0].token_ids, kept[0].sources) if s != Source.HINT][: b - n_hint]
    (packed,) = self_distillation_examples(kept, packed=True)
    assert sum(packed.targets) == kept[0].num_policy_tokens
    with pytest.raises(ValueError, match="has no tokens or turns"):
        self_distillation_examples([kg_episode("<answer>Paris</answer>")])


def test_trajectories_file_round_trip_and_errors(tmp_path, tiny):
    _, tok = tiny
    from keel.sft import gold_trajectory

    gold = gold_trajectory(tok, KG_ENV, kg_task())
    path = tmp_path / "kept.jsonl"
    write_trajectories(path, [gold, gold])
    back = read_trajectories(path)
    assert len(back) == 2 and back[0].token_ids == gold.token_ids and back[0].turn_spans == gold.turn_spans and back[0].answer == "Paris"
    path.write_text(path.read_text() + '{"task_id": "x"}\n')
    with pytest.raises(ValueError, match=r"kept.jsonl:3: not a trajectory \(KeyError"):
        read_trajectories(path)
    with pytest.raises(FileNotFoundError, match="file not found: .*missing.jsonl"):
        read_trajectories(tmp_path / "missing.jsonl")


def test_distill_round_on_a_random_model(tiny):
    from keel.signals.restem import distill

    model, tok = tiny
    kept, counts = distill(model, tok, KG_ENV, [kg_task(), kg_task()], SamplingParams(max_turns=2, max_new_tokens=8), batch_size=2)
    assert kept == [] and counts == {"kept": 0, "not_correct": 2, "no_successful_call": 0, "invalid_format": 0}
