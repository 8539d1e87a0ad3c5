"""Structural states of outputs (paper A) and format drift (paper B), on hand-made turns."""

from __future__ import annotations

import pytest

from keel.diagnostics.states import (
    FULL_COLLAPSE,
    HEALTHY_RESPONSE,
    HEALTHY_TOOL_CALL,
    TEXT_POLLUTION,
    classify_output,
    has_format_drift,
    structural_shares,
    trajectory_state,
    turn_states,
)
from keel.types import Trajectory

CALL = '<tool_call>\n{"name": "get_tail_relations", "arguments": {"entity": "m.1"}}\n</tool_call>'

CASES = [
    # healthy tool calls
    (CALL + "<|im_end|>", True, HEALTHY_TOOL_CALL, "calls parse"),
    ("Let me look up the relations.\n" + CALL, True, HEALTHY_TOOL_CALL, "calls parse"),
    ("<think>first the relations</think>\n" + CALL + "\n" + CALL, True, HEALTHY_TOOL_CALL, "calls parse"),
    # healthy responses
    ("<answer>Honolulu</answer><|im_end|>", True, HEALTHY_RESPONSE, "answer"),
    ("<think>it was in the list</think>\n<answer>Honolulu</answer>", True, HEALTHY_RESPONSE, "answer"),
    ("The file has been moved.", False, HEALTHY_RESPONSE, "plain response"),
    # text pollution
    ('<tool_call>\n{name: "f"}\n</tool_call>', True, TEXT_POLLUTION, "call does not parse (bad_json)"),
    ('<tool_call>\n{"name": "f", "arguments": {}}', True, TEXT_POLLUTION, "unbalanced call tags (1 open, 0 close)"),
    ("```json\n" + CALL + "\n```", True, TEXT_POLLUTION, "garbage around call"),
    (CALL + "\nand then I will answer", True, TEXT_POLLUTION, "text after call"),
    ('{"name": "f"} ' + CALL, True, TEXT_POLLUTION, "garbage around call"),
    ("<answer></answer>", True, TEXT_POLLUTION, "empty answer"),
    ("</tool_response> so <answer>Paris</answer>", True, TEXT_POLLUTION, "tag in response"),
    ("<answer>Paris</answer> because it is big", True, TEXT_POLLUTION, "text after answer"),
    ("<answer>Paris</answer><answer>Rome</answer>", True, TEXT_POLLUTION, "answer tags not exactly one pair"),
    (CALL + "<answer>Paris</answer>", True, TEXT_POLLUTION, "answer and call in one turn"),
    ("<think>I will <search>get_tail_relations(m.1)</search></think>", True, TEXT_POLLUTION, "tag inside think"),
    ("Done.<|im_start|>user", False, TEXT_POLLUTION, "tag in response"),
    # full collapse
    ("", True, FULL_COLLAPSE, "empty"),
    ("  <|im_end|>", True, FULL_COLLAPSE, "empty"),
    ("<tool_call><tool_call>\n<tool_call>", True, FULL_COLLAPSE, "repeated tag <tool_call>"),
    ("ok</tool_call></tool_call></tool_call></tool_call>", True, FULL_COLLAPSE, "repeated tag </tool_call>"),
    ("}}}}}}}}", True, FULL_COLLAPSE, "repeated text"),
    ("the the the the the", False, FULL_COLLAPSE, "repeated text"),
    ("I think the answer is Paris.", True, FULL_COLLAPSE, "no structure"),
    ("<think>hmm</think>", True, FULL_COLLAPSE, "no structure"),
    ("<think>hmm</think>", False, FULL_COLLAPSE, "no structure"),
]


@pytest.mark.parametrize("text,require_answer,state,reason", CASES)
def test_each_state(text, require_answer, state, reason):
    assert classify_output(text, require_answer) == (state, reason)


def test_format_drift():
    assert has_format_drift("<think>call <tool_call>{}</tool_call></think>")
    assert has_format_drift("<think>still thinking <search>x</search>")  # unclosed think
    assert not has_format_drift("<think>ok</think><search>x</search>")
    assert not has_format_drift(CALL)


def make(texts):
    return Trajectory(task_id="t", token_ids=[], sources=[], logprobs=[], turn_texts=texts)


def test_trajectory_state_and_batch_shares():
    good = make([CALL, "<answer>Honolulu</answer>"])
    polluted = make([CALL, "<answer></answer>"])
    drifted = make(["<think><search>get_tail_relations(m.1)</search></think>", "<tool_call><tool_call><tool_call>"])
    assert turn_states(good) == [HEALTHY_TOOL_CALL, HEALTHY_RESPONSE]
    assert trajectory_state(good) == HEALTHY_RESPONSE
    assert trajectory_state(polluted) == TEXT_POLLUTION
    assert trajectory_state(drifted) == FULL_COLLAPSE
    assert trajectory_state(make([])) == FULL_COLLAPSE
    shares = structural_shares([good, polluted, drifted])
    # 6 turns: calls 2, response 1, pollution 2 (empty answer, tag inside think), collapse 1; drift 1.
    assert shares == {
        "collapse/healthy_tool_call": 2 / 6,
        "collapse/healthy_response": 1 / 6,
        "collapse/text_pollution": 2 / 6,
        "collapse/full_collapse": 1 / 6,
        "collapse/format_drift": 1 / 6,
    }
    assert structural_shares([]) == {}
