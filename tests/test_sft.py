"""Paper A's single-step decomposition, and its equivalence with the packed form."""

import pytest
import torch

from fakes import EchoEnv, make_tasks
from keel.logprobs import token_logprobs
from keel.sft import collate_sft, decompose, gold_trajectory
from keel.types import Source, Trajectory


def _hand_traj():
    # prompt 0..4, turn 0 = 5..8, tool 9..13, turn 1 = 14..16
    sources = [0] * 5 + [4] * 4 + [2] * 5 + [4] * 3
    return Trajectory(task_id="t", token_ids=list(range(100, 117)), sources=sources, logprobs=[0.0] * 17, turn_spans=[(5, 9), (14, 17)])


def test_decomposition_by_hand():
    ex = decompose(_hand_traj())
    assert len(ex) == 2
    assert ex[0].token_ids == list(range(100, 109)) and [i for i, t in enumerate(ex[0].targets) if t] == [5, 6, 7, 8]
    assert ex[1].token_ids == list(range(100, 117)) and [i for i, t in enumerate(ex[1].targets) if t] == [14, 15, 16]
    packed = decompose(_hand_traj(), packed=True)
    assert len(packed) == 1 and [i for i, t in enumerate(packed[0].targets) if t] == [5, 6, 7, 8, 14, 15, 16]


def test_sft_rows_carry_sources_and_go_through_rl_collate():
    ex = decompose(_hand_traj())
    # Example 1 is the whole trajectory: its turn-0 tokens (expert) are context there, so PROMPT.
    assert ex[1].sources == [0] * 14 + [4] * 3 and ex[0].sources == [0] * 5 + [4] * 4
    tr = _hand_traj()
    tr.sources[14] = int(Source.HINT)  # a hint inside a target span is context to SFT, and is not dropped
    (hinted,) = decompose(tr, packed=True)
    assert hinted.sources[14] == Source.PROMPT and len(hinted.token_ids) == 17
    ids, attn, tmask = collate_sft(ex, pad_id=7)
    assert ids.shape == (2, 17) and ids[0, 9:].tolist() == [7] * 8 and attn[0].sum() == 9
    assert [i for i, t in enumerate(tmask[0].tolist()) if t] == [5, 6, 7, 8]
    assert [i for i, t in enumerate(tmask[1].tolist()) if t] == [14, 15, 16]
    with pytest.raises(ValueError, match="not SFT target sources"):
        decompose(_hand_traj(), target_sources=(Source.TOOL,))


def test_saved_reflections_load_in_either_row_form():
    from keel.signals.reflection import _with_sources

    new = [[1, 2, 3], [0, 5, 5], "t", 0]
    assert _with_sources(new) == new
    assert _with_sources([[1, 2, 3], [False, True, True], "t", 0]) == new  # rows saved as target flags


def test_packed_equals_single_step_loss(tiny):
    """Causal model: the summed NLL of every turn is the same in one packed sequence or one example per turn."""
    model, tok = tiny
    env = EchoEnv()
    task = make_tasks(1)[0]
    task.gold_turns = [[{"name": "lookup", "arguments": {"x": "a"}}], [{"name": "lookup", "arguments": {"x": "b"}}]]
    gold = gold_trajectory(tok, env, task)
    assert len(gold.turn_spans) == 3 and gold.finished and gold.info["gold_ok"]
    assert gold.answer == "item0"
    single = decompose(gold)
    packed = decompose(gold, packed=True)
    with torch.no_grad():
        ids, attn, tm = collate_sft(single, tok.pad_token_id)
        lp_single, _ = token_logprobs(model, ids, attn, tm)
        ids, attn, tm = collate_sft(packed, tok.pad_token_id)
        lp_packed, _ = token_logprobs(model, ids, attn, tm)
    assert lp_single.shape == lp_packed.shape
    assert torch.allclose(lp_single, lp_packed, atol=1e-5)
    assert abs(lp_single.sum().item() - lp_packed.sum().item()) < 1e-3


def test_gold_targets_are_expert_turns_ending_with_im_end(tiny):
    _, tok = tiny
    env = EchoEnv()
    task = make_tasks(1)[0]
    task.gold_turns = [[{"name": "lookup", "arguments": {"x": "a"}}]]
    gold = gold_trajectory(tok, env, task)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for a, b in gold.turn_spans:
        assert all(s == Source.EXPERT for s in gold.sources[a:b]) and gold.token_ids[b - 1] == eos
    assert tok.decode(gold.token_ids[gold.turn_spans[-1][0] : gold.turn_spans[-1][1]]) == "<answer>item0</answer><|im_end|>"
