"""Hint-based guidance: hint texts, hint placement, and the loss seeing only hint-free sequences."""

from __future__ import annotations

import pytest
import torch

from keel.fc.bfcl import BfclEnv
from keel.fc.learnable import generate_tasks
from keel.logprobs import collate, token_logprobs
from keel.rollout import SamplingParams, encode_prompt, rollout
from keel.signals.hints import HintPolicy, build_hint, encode_prompt_with_hint, first_call_hint, function_names_hint, relation_path_hint, strip_hints
from keel.signals.ops import gold_steer
from keel.types import Source, Task, Trajectory
from test_signals_ops import KG_ENV, kg_task


def test_hint_texts():
    task = kg_task()
    assert first_call_hint(task, KG_ENV) == (
        'Hint: a good first call is {"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}'
    )
    assert relation_path_hint(task) == "Hint: the answer is reached through the relations film.film.directed_by -> people.person.place_of_birth"
    task.gold_triples = []  # falls back to the gold calls' relation arguments: same path here
    assert relation_path_hint(task) == "Hint: the answer is reached through the relations film.film.directed_by -> people.person.place_of_birth"
    assert relation_path_hint(Task(id="x", question="", answers=["a"])) is None
    fc = generate_tasks(2, seed=0)[1]  # cd then touch
    assert function_names_hint(fc) == "Hint: the functions needed are cd, touch"
    assert first_call_hint(fc, BfclEnv("python")) == "Hint: a good first call is cd(folder='notes')"
    assert build_hint(kg_task(), KG_ENV, ["relation_path", "function_names"]) == (
        "Hint: the answer is reached through the relations film.film.directed_by -> people.person.place_of_birth\n"
        "Hint: the functions needed are get_tail_entities"
    )
    assert build_hint(Task(id="x", question="", answers=["a"]), None, ["first_call"]) is None
    with pytest.raises(ValueError, match=r"unknown hint kind\(s\) \['gold_answer'\]"):
        build_hint(kg_task(), KG_ENV, ["gold_answer"])


@pytest.mark.parametrize("position", ["system", "user"])
def test_dropping_hint_tokens_leaves_the_hint_free_prompt(tiny, position):
    _, tok = tiny
    task = kg_task()
    plain, plain_src = encode_prompt(tok, KG_ENV, task)
    ids, src = encode_prompt_with_hint(tok, KG_ENV, task, "Hint: follow film.film.directed_by", position)
    hint_at = [i for i, s in enumerate(src) if s == Source.HINT]
    assert hint_at and hint_at == list(range(hint_at[0], hint_at[-1] + 1))  # one contiguous block
    assert [t for t, s in zip(ids, src) if s != Source.HINT] == plain
    text_before = tok.decode(ids[: hint_at[0]])
    if position == "system":
        assert ids == encode_prompt(tok, KG_ENV, task, "Hint: follow film.film.directed_by")[0]
        assert "<|im_start|>user" not in text_before
    else:
        assert text_before.endswith("Topic entity: Heat (m.film)") and "<tools>" in text_before
    assert encode_prompt_with_hint(tok, KG_ENV, task, None, position) == (plain, plain_src)
    with pytest.raises(ValueError, match="signals.hint.position: 'assistant'"):
        encode_prompt_with_hint(tok, KG_ENV, task, "h", "assistant")


def test_strip_hints_by_hand():
    tr = Trajectory(task_id="t", token_ids=[10, 11, 12, 13, 14, 15, 16], sources=[0, 0, 3, 3, 0, 1, 1], logprobs=[0, 0, 0, 0, 0, -1.0, -2.0], turn_spans=[(5, 7)])
    out = strip_hints(tr)
    assert out.token_ids == [10, 11, 14, 15, 16] and out.sources == [0, 0, 0, 1, 1] and out.turn_spans == [(3, 5)]
    assert out.logprobs == [0, 0, 0, -1.0, -2.0] and tr.token_ids[2] == 12  # the original is untouched


@pytest.mark.parametrize("position", ["system", "user"])
def test_loss_sees_the_hint_free_sequence(tiny, position):
    """Rows with hints of different lengths and a row without: the collated (trained) batch has
    no hint token, and its log-probs equal each trajectory re-encoded without the hint, alone."""
    model, tok = tiny
    task = kg_task()
    rows = [task, task, task]
    hints = ["Hint: the first hop is film.film.directed_by, the second people.person.place_of_birth.", None, "Hint: m.film."]
    params = SamplingParams(temperature=1.0, max_turns=2, max_new_tokens=64, max_total_tokens=4096)
    steer = gold_steer(tok, KG_ENV, rows, [0, 1, 2])
    first_turn_only = lambda row, turn: steer(row, turn) if turn == 0 else None  # noqa: E731 - gold call, then a sampled turn
    trajs = rollout(model, tok, KG_ENV, rows, params, generator=torch.Generator().manual_seed(0), hints=hints, steer=first_turn_only, groups=[0, 0, 0], hint_position=position)
    n_hint = [sum(s == Source.HINT for s in tr.sources) for tr in trajs]
    assert n_hint[0] > n_hint[2] > 0 and n_hint[1] == 0
    assert all(any(s == Source.TOOL for s in tr.sources) and len(tr.turn_spans) == 2 for tr in trajs)

    batch = collate(trajs, sources=(Source.POLICY, Source.EXPERT), pad_id=tok.pad_token_id)
    plain_prompt, _ = encode_prompt_with_hint(tok, KG_ENV, task, None, position)
    hint_free = []
    for b, tr in enumerate(trajs):
        prompt_end = tr.turn_spans[0][0]
        re_encoded = Trajectory(task_id=tr.task_id, token_ids=plain_prompt + tr.token_ids[prompt_end:],
                                sources=[int(Source.PROMPT)] * len(plain_prompt) + tr.sources[prompt_end:], logprobs=[0.0] * len(plain_prompt) + tr.logprobs[prompt_end:])
        n = int(batch.attention_mask[b].sum())
        assert batch.input_ids[b, :n].tolist() == re_encoded.token_ids == strip_hints(tr).token_ids
        hint_free.append(re_encoded)
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask)
        alone = []
        for tr in hint_free:
            one = collate([tr], sources=(Source.POLICY,), pad_id=tok.pad_token_id)
            alone.append(token_logprobs(model, one.input_ids, one.attention_mask, one.target_mask)[0])
    assert trained.shape == torch.cat(alone).shape
    assert (trained - torch.cat(alone)).abs().max().item() <= 1e-5
    # ... and they are not the sampling log-probs of the hinted rows (those saw the hint)
    counts = [int(batch.target_mask[b].sum()) for b in range(3)]
    per_row = torch.split(trained, counts)
    sampled = [torch.tensor([lp for lp, s in zip(tr.logprobs, tr.sources) if s == Source.POLICY]) for tr in trajs]
    assert (per_row[0] - sampled[0]).abs().max().item() > 1e-3
    assert (per_row[1] - sampled[1]).abs().max().item() <= 1e-4  # the unhinted row: same context


def test_hint_policy_only_failed_groups():
    a, b = kg_task(), kg_task()
    b.id = "t1"
    always = HintPolicy(KG_ENV, kinds=["relation_path"])
    assert always.hints_for([a, b]) == [relation_path_hint(a)] * 2
    policy = HintPolicy(KG_ENV, kinds=["relation_path"], only_failed=True)
    assert policy.hints_for([a, b]) == [None, None]  # never seen: no failure yet
    policy.observe(["t0", "t1"], [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    assert policy.hints_for([a, b]) == [relation_path_hint(a), None]
    state = policy.state_dict()
    policy.observe(["t0"], [[0.0, 0.5]])  # the hinted group succeeded: hint cleared
    assert policy.hints_for([a]) == [None]
    policy.load_state_dict(state)
    assert policy.hints_for([a]) == [relation_path_hint(a)]
    with pytest.raises(ValueError, match="2 task ids but 1 groups"):
        policy.observe(["t0", "t1"], [[0.0]])
    with pytest.raises(ValueError, match="empty group"):
        policy.observe(["t0"], [[]])
    with pytest.raises(ValueError, match="expected {'failed'"):
        policy.load_state_dict({"failed": "t0"})
    with pytest.raises(ValueError, match="unknown hint kind"):
        HintPolicy(KG_ENV, kinds=["nope"])
    with pytest.raises(ValueError, match="position"):
        HintPolicy(KG_ENV, position="footer")


def test_the_config_knows_every_hint_kind_and_no_other():
    from keel.config import HINT_KINDS
    from keel.signals.hints import HINTS

    assert tuple(HINTS) == HINT_KINDS
