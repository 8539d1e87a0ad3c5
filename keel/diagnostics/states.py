"""Paper A's four structural states of a model output, and paper B's format drift.

Paper A sorts outputs into healthy tool call, healthy response, text pollution and full
collapse, and watches the last two rise as control tokens take over. The paper gives no exact
rules; the rules below are Keel's, written to be checkable by hand. An "output" is one
assistant turn (`Trajectory.turn_texts[i]`).

Rules, applied in this order to the turn text with one trailing `<|im_end|>` and surrounding
whitespace removed (the *body*); "tags" are `keel.chat.CONTROL_TAGS`:

1. **full collapse** when
   a. the body is empty (`""`, `"<|im_end|>"`);
   b. a control tag repeats 3+ times in a row with only whitespace between
      (`"<tool_call><tool_call><tool_call>"`);
   c. the whole body is one unit of at most 20 characters repeated 4+ times
      (`"}}}}}}"`, `"ok ok ok ok"`);
   d. no recognisable structure: no call attempt (`<tool_call>`, `</tool_call>`, `<search>`,
      `</search>`) and, when an answer tag is required, no `<answer>`/`</answer>` either
      (`"I think the answer is Paris."` in a KG episode; `"<think>hmm</think>"`); when no
      answer tag is required, a body that is only a think block.
2. **healthy tool call** when the body (after one leading `<think>…</think>` block) contains
   only well-formed calls: every `<tool_call>…</tool_call>` parses (`keel.chat.parse_tool_calls`),
   opening and closing tags pair up, no answer tag, and the text outside the call blocks holds
   no control tag, no `{`/`}`, no code fence, and nothing after the last `</tool_call>`; the
   think block holds no control tag. Short prose before the calls is allowed
   (`"Let me look.\\n<tool_call>\\n{...}\\n</tool_call>"`).
3. **healthy response** when there is no call attempt and, after a leading think block free of
   tags: with an answer tag required, exactly one `<answer>…</answer>` with non-empty content,
   nothing after it, and no other control tag (`"<answer>Paris</answer>"`); without, no
   control tag at all (`"The file was moved."`).
4. **text pollution** otherwise: some structure is there but broken: a call that does not parse
   (`"<tool_call>{name: f}</tool_call>"`), unbalanced tags (`"<tool_call>\\n{...}"`), tags
   leaking into text (`"</tool_response> the answer is"`), garbage around a call
   (`"```json\\n<tool_call>…</tool_call>\\n```"`), an empty `<answer></answer>`, or an answer and
   a call in one turn.

**Format drift** (paper B, mode 3) is a flag, not a state: a tool tag (`<tool_call>` or
`<search>`) inside a `<think>…</think>` block (or an unclosed `<think>` running to the end).
"""

from __future__ import annotations

import re

from keel.chat import CONTROL_TAGS, IM_END, parse_tool_calls
from keel.metrics import (
    COLLAPSE_FORMAT_DRIFT,
    COLLAPSE_FULL,
    COLLAPSE_HEALTHY_CALL,
    COLLAPSE_HEALTHY_RESPONSE,
    COLLAPSE_TEXT_POLLUTION,
)
from keel.types import Trajectory

HEALTHY_TOOL_CALL = "healthy_tool_call"
HEALTHY_RESPONSE = "healthy_response"
TEXT_POLLUTION = "text_pollution"
FULL_COLLAPSE = "full_collapse"
STATES = (HEALTHY_TOOL_CALL, HEALTHY_RESPONSE, TEXT_POLLUTION, FULL_COLLAPSE)
STATE_METRICS = {
    HEALTHY_TOOL_CALL: COLLAPSE_HEALTHY_CALL,
    HEALTHY_RESPONSE: COLLAPSE_HEALTHY_RESPONSE,
    TEXT_POLLUTION: COLLAPSE_TEXT_POLLUTION,
    FULL_COLLAPSE: COLLAPSE_FULL,
}
SEVERITY = {HEALTHY_TOOL_CALL: 0, HEALTHY_RESPONSE: 0, TEXT_POLLUTION: 1, FULL_COLLAPSE: 2}

CALL_TAGS = ("<tool_call>", "</tool_call>", "<search>", "</search>")
TOOL_TAGS_IN_THINK = ("<tool_call>", "<search>")
TAG_REPEATS = 3  # a tag 3 times in a row is never template-conform
UNIT_MAX_CHARS, UNIT_REPEATS = 20, 4

_ANY_TAG = re.compile("(?:" + "|".join(re.escape(t) for t in CONTROL_TAGS) + ")")
_REPEATED_TAG = re.compile("(" + "|".join(re.escape(t) for t in sorted(CONTROL_TAGS, key=len, reverse=True)) + r")(?:\s*\1){%d,}" % (TAG_REPEATS - 1))
_REPEATED_UNIT = re.compile(r"^(.{1,%d}?)(?:\s*\1){%d,}$" % (UNIT_MAX_CHARS, UNIT_REPEATS - 1), re.DOTALL)
_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
_THINK_BLOCK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)


def _body(text: str) -> str:
    body = (text or "").strip()
    if body.endswith(IM_END):
        body = body[: -len(IM_END)].strip()
    return body


def _has_tag(text: str) -> bool:
    return _ANY_TAG.search(text) is not None


def _split_think(body: str) -> tuple[str, str]:
    """(think content, rest) for a body that opens with a closed think block; else ("", body)."""
    if body.startswith("<think>") and "</think>" in body:
        inner, rest = body[len("<think>") :].split("</think>", 1)
        return inner, rest.strip()
    return "", body


def classify_output(text: str, require_answer_tag: bool = True) -> tuple[str, str]:
    """(state, reason) of one assistant turn under the rules of the module docstring.

    >>> classify_output('<tool_call>\\n{"name": "f", "arguments": {}}\\n</tool_call><|im_end|>')
    ('healthy_tool_call', 'calls parse')
    >>> classify_output('<tool_call><tool_call><tool_call>')
    ('full_collapse', 'repeated tag <tool_call>')
    """
    body = _body(text)
    if not body:
        return FULL_COLLAPSE, "empty"
    m = _REPEATED_TAG.search(body)
    if m:
        return FULL_COLLAPSE, f"repeated tag {m.group(1)}"
    if _REPEATED_UNIT.match(body):
        return FULL_COLLAPSE, "repeated text"
    call_attempt = any(t in body for t in CALL_TAGS)
    answer_tag = "<answer>" in body or "</answer>" in body
    think, rest = _split_think(body)
    if not call_attempt and ((require_answer_tag and not answer_tag) or (not require_answer_tag and not rest)):
        return FULL_COLLAPSE, "no structure"
    if _has_tag(think):
        return TEXT_POLLUTION, "tag inside think"
    if call_attempt:
        if answer_tag:
            return TEXT_POLLUTION, "answer and call in one turn"
        if "<search>" in rest or "</search>" in rest:
            return TEXT_POLLUTION, "search tag (not this template's call format)"
        calls = parse_tool_calls(rest)
        n_open, n_close = rest.count("<tool_call>"), rest.count("</tool_call>")
        if not (n_open == n_close == len(calls)):
            return TEXT_POLLUTION, f"unbalanced call tags ({n_open} open, {n_close} close)"
        errors = [c.error for c in calls if c.error]
        if errors:
            return TEXT_POLLUTION, f"call does not parse ({errors[0]})"
        outside = _CALL_BLOCK.sub("\n", rest)
        if _has_tag(outside) or "{" in outside or "}" in outside or "```" in outside:
            return TEXT_POLLUTION, "garbage around call"
        if rest[rest.rfind("</tool_call>") + len("</tool_call>") :].strip():
            return TEXT_POLLUTION, "text after call"
        return HEALTHY_TOOL_CALL, "calls parse"
    if not require_answer_tag:
        return (TEXT_POLLUTION, "tag in response") if _has_tag(rest) else (HEALTHY_RESPONSE, "plain response")
    if rest.count("<answer>") != 1 or rest.count("</answer>") != 1:
        return TEXT_POLLUTION, "answer tags not exactly one pair"
    head, tail = rest.split("<answer>", 1)
    content, after = tail.split("</answer>", 1) if "</answer>" in tail else ("", "<unclosed>")
    if after.strip():
        return TEXT_POLLUTION, "text after answer"
    if not content.strip():
        return TEXT_POLLUTION, "empty answer"
    if _has_tag(head) or _has_tag(content):
        return TEXT_POLLUTION, "tag in response"
    return HEALTHY_RESPONSE, "answer"


def has_format_drift(text: str) -> bool:
    """A tool tag (`<tool_call>` or `<search>`) inside a think block (closed or running to the end).

    >>> has_format_drift("<think>I will <search>get_tail_relations(m.1)</search></think>")
    True
    """
    return any(any(t in m.group(1) for t in TOOL_TAGS_IN_THINK) for m in _THINK_BLOCK.finditer(text or ""))


def turn_states(traj: Trajectory, require_answer_tag: bool = True) -> list[str]:
    """The state of each assistant turn of a trajectory."""
    return [classify_output(t, require_answer_tag)[0] for t in traj.turn_texts]


def trajectory_state(traj: Trajectory, require_answer_tag: bool = True) -> str:
    """The worst state among a trajectory's turns (full collapse > pollution > healthy); the last
    turn decides between the two healthy states. A trajectory without turns is full collapse."""
    states = turn_states(traj, require_answer_tag)
    if not states:
        return FULL_COLLAPSE
    worst = max(SEVERITY[s] for s in states)
    return states[-1] if worst == 0 else next(s for s in (FULL_COLLAPSE, TEXT_POLLUTION) if SEVERITY[s] == worst)


def structural_shares(trajs: list[Trajectory], require_answer_tag: bool = True) -> dict[str, float]:
    """Shares of all assistant turns of a batch in each state, plus the format-drift share, under
    the `collapse/...` metric names. {} for a batch without turns."""
    texts = [t for traj in trajs for t in traj.turn_texts]
    if not texts:
        return {}
    counts = dict.fromkeys(STATES, 0)
    drift = 0
    for text in texts:
        counts[classify_output(text, require_answer_tag)[0]] += 1
        drift += has_format_drift(text)
    out = {STATE_METRICS[s]: counts[s] / len(texts) for s in STATES}
    out[COLLAPSE_FORMAT_DRIFT] = drift / len(texts)
    return out
