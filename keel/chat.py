"""Tool-aware ChatML (Hermes / Qwen2.5 style) in token space, tool-call parsing, control tags.

Keel renders the conversation itself, piece by piece, so that the ids the policy sampled are
the ids trained on: the prompt is encoded once, each assistant turn is the sampled ids, and
each tool response is encoded on its own and appended. The layout is Qwen2.5's:

    <|im_start|>system\n{instructions}\n\n# Tools ... <tools>\n{schema}\n</tools> ...<|im_end|>\n
    <|im_start|>user\n{question}<|im_end|>\n
    <|im_start|>assistant\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>
    \n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n

The "\n" after an assistant's <|im_end|> belongs to the tool/user block that follows (it is
template, not policy), so a policy turn always ends exactly at its <|im_end|>.
A model's own chat template can render the conversation instead: keel.templates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from keel.types import ToolCall

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Every control tag of the template. Telemetry classifies tokens by these, whether a tag is one
# added token (Qwen2.5's <tool_call> = 151657) or several ordinary ones (SmolLM2: 5 tokens).
CONTROL_TAGS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<tools>",
    "</tools>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
)

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)

# A Jinja version of the same layout, installed as the tokenizer's chat_template so that
# `tokenizer.apply_chat_template(messages, tools=...)` renders exactly what Keel renders.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_POSTAMBLE) + " + '<|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_system(instructions: str, tools: list[dict[str, Any]]) -> str:
    """The system block text (without the trailing "\\n" after <|im_end|>)."""
    body = instructions
    if tools:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        body = (instructions + "\n\n" if instructions else "") + TOOLS_PREAMBLE + schemas + TOOLS_POSTAMBLE
    return f"{IM_START}system\n{body}{IM_END}\n"


def render_tool_responses(results: list[str]) -> str:
    """Text appended after an assistant turn that made calls: the tool results, then a new
    assistant header. Starts with the "\\n" that follows the assistant's <|im_end|>."""
    blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    return f"\n{IM_START}user{blocks}{IM_END}\n{IM_START}assistant\n"


def render_user_turn(message: str) -> str:
    """Text appended after an assistant turn without calls when the conversation continues."""
    return f"\n{IM_START}user\n{message}{IM_END}\n{IM_START}assistant\n"


def render_assistant_calls(calls: list[dict[str, Any]], content: str = "") -> str:
    """Gold assistant text for a turn of calls (used for SFT targets and expert members)."""
    parts = [content] if content else []
    for c in calls:
        parts.append("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(parts)


_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_CALL_CHARS = 16384  # a call longer than this is rejected before json parsing (BFCL long_context gold calls reach 6,743)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>…</tool_call> block of an assistant turn, parsed as JSON.

    Never raises: a block that is not `{"name": str, "arguments": object}` becomes a ToolCall
    with `error` set (`bad_json`, `bad_call`, `too_long`). An opening tag without its closing
    tag is one call with error `unclosed_tag`.

    >>> [c.name for c in parse_tool_calls('<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')]
    ['f']
    """
    calls: list[ToolCall] = []
    for m in _CALL_RE.finditer(text):
        calls.append(parse_call_json(m.group(1)))
    tail = text[text.rfind("</tool_call>") + len("</tool_call>") :] if "</tool_call>" in text else text
    if "<tool_call>" in tail:
        raw = tail[tail.index("<tool_call>") :]
        calls.append(ToolCall(name="", arguments={}, raw=raw[:MAX_CALL_CHARS], error="unclosed_tag"))
    return calls


def parse_call_json(body: str) -> ToolCall:
    """One call written as JSON, `{"name": str, "arguments": object}` ("parameters" is read as
    "arguments", Llama-3.1's key). Never raises: a bad body is a ToolCall with `error` set."""
    raw = body.strip()
    if len(raw) > MAX_CALL_CHARS:
        return ToolCall(name="", arguments={}, raw=raw[:MAX_CALL_CHARS], error="too_long")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return ToolCall(name="", arguments={}, raw=raw, error="bad_json")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(name="", arguments={}, raw=raw, error="bad_call")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments object as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError, ValueError):
            return ToolCall(name=obj["name"], arguments={}, raw=raw, error="bad_json")
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], arguments={}, raw=raw, error="bad_call")
    return ToolCall(name=obj["name"], arguments=args, raw=raw)


def extract_answer(text: str) -> str:
    """The answer of a final turn, as paper B's reward code reads it: when the text has both
    tags, what follows the first <answer> up to the next </answer>; else the text after the
    last </think>; else the whole text.

    The first tag, not the last: a turn with several answers (a pollution state in
    `keel.diagnostics.states`) is paid for its first, as in the paper's runs. Their code
    applied this to the whole output; Keel applies it to the final turn (the one without a
    call), so an <answer> written beside a call in an earlier turn is not the answer.
    >>> extract_answer("<answer>Paris</answer> or <answer>Rome</answer>")
    'Paris'
    """
    if "<answer>" in text and "</answer>" in text:
        return text.split("<answer>", 1)[1].split("</answer>", 1)[0].strip()
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1].strip()
    return text.strip()


def has_answer_tag(text: str) -> bool:
    return _ANSWER_RE.search(text) is not None


@dataclass
class TagSpan:
    tag: str
    start: int  # first token index covering the tag
    end: int  # one past the last token index covering the tag


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token decoded on its own. Byte-level pieces of a multi-byte character decode to
    replacement characters; tags are ASCII, so tag positions are unaffected."""
    return [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in token_ids]


def find_tag_spans(pieces: list[str], tags: tuple[str, ...] = CONTROL_TAGS) -> list[TagSpan]:
    """Occurrences of control tags in a token sequence given as per-token texts.

    Works whether a tag is one token or several: the pieces are joined, tags are found in the
    text, and each occurrence is mapped back to the tokens whose characters it covers.
    Worked example: pieces ["<", "tool", "_", "call", ">", "{"] → [TagSpan("<tool_call>", 0, 5)].
    """
    starts: list[int] = []
    pos = 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    text = "".join(pieces)
    spans: list[TagSpan] = []
    # Longest tags first so "</tool_call>" is not also counted as a "<tool_call>"-like prefix.
    for tag in sorted(tags, key=len, reverse=True):
        i = text.find(tag)
        while i >= 0:
            spans.append(TagSpan(tag, _token_at(starts, i), _token_at(starts, i + len(tag) - 1) + 1))
            i = text.find(tag, i + len(tag))
    spans.sort(key=lambda s: s.start)
    return spans


def _token_at(starts: list[int], char: int) -> int:
    import bisect

    return bisect.bisect_right(starts, char) - 1


def token_tag_labels(pieces: list[str], tags: tuple[str, ...] = CONTROL_TAGS) -> list[str | None]:
    """Per token: the control tag it is part of, or None for ordinary text."""
    labels: list[str | None] = [None] * len(pieces)
    for span in find_tag_spans(pieces, tags):
        for k in range(span.start, span.end):
            labels[k] = span.tag
    return labels


def render_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """Keel messages (system/user/assistant/tool) as the text the rollout engine builds in token
    space, ending with an open assistant header. Used by text policies that wrap a model."""
    out = render_system(messages[0]["content"] if messages and messages[0]["role"] == "system" else "", tools)
    pending_tools: list[str] = []
    for m in messages:
        role = m["role"]
        if role == "system":
            continue
        if role == "tool":
            pending_tools.append(m["content"])
            continue
        if pending_tools:
            out += f"{IM_START}user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in pending_tools) + f"{IM_END}\n"
            pending_tools = []
        out += f"{IM_START}{role}\n{m['content']}{IM_END}\n"
    if pending_tools:
        out += f"{IM_START}user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in pending_tools) + f"{IM_END}\n"
    return out + f"{IM_START}assistant\n"
