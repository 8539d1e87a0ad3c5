"""The model's own chat template, rendered by `tokenizer.apply_chat_template`, token-in/token-out.

Keel's default renders Hermes/Qwen2.5 ChatML itself (keel.chat). A model whose tokenizer has a
tool-aware template (Qwen2.5, Hermes, Llama-3.1 style) can be rendered by that template instead,
and the ids the policy sampled are still the ids trained on:

- the prompt is the template's rendering of [system, user] with the generation prompt, encoded once;
- an assistant turn is the sampled ids, closed by the family's end-of-turn token (<|im_end|>,
  <|eot_id|>). The end token belongs to the policy turn, as <|im_end|> does in keel.chat: the
  model is trained to stop, and the template's text after it (ChatML's "\\n") is in the delta;
- what follows the turn (tool results, or the environment's next user message) is the template's
  delta: its rendering of the conversation with the new messages and the generation prompt,
  minus the text the policy has seen so far (prompt + sampled turns + earlier deltas), encoded on
  its own and appended. For ChatML that is "\\n<|im_start|>user\\n<tool_response>\\n...
  </tool_response><|im_end|>\\n<|im_start|>assistant\\n", exactly keel.chat.render_tool_responses.

Assistant turns go to the template as their sampled text (`content`), never as structured
`tool_calls`: templates re-serialise those (`tojson`) and would not reproduce the sampled text.

The delta exists only when the new rendering extends the text already seen. When it does not,
where the two first differ decides (`Conversation.extend`):
- before the turn just sampled: the template re-renders earlier turns once a turn is added.
  Keel never re-encodes history, so the template is refused (UserError, one line);
- inside that turn, which the template rendered as written while it was the last turn: the added
  messages changed it (Qwen3's template drops the <think> block of every assistant turn that
  precedes a later user message). Refused the same way;
- inside that turn, which the template never renders as written (Llama-3.1's template trims
  each turn, so a turn ending in a space is not reproduced): the model's text is outside the
  template's format. That episode ends (`extend` returns None); nothing is raised into the loop.
`ChatTemplate.from_tokenizer` runs a short probe conversation in the family's own call format,
so a template of the first two kinds is refused before anything is sampled.

Departure from the issue's wording (the delta between the template's renderings before and after
the tool response): the reference is the text the policy has seen, not the template's rendering
that ends with the assistant turn. The two agree whenever the template renders the sampled turn
as written; a template may render the *last* assistant turn specially (Qwen3's adds an empty
<think></think> block there that it drops once the turn is followed by a tool response), a
rendering no prompt of the episode ever contains.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from keel.chat import MAX_CALL_CHARS, parse_call_json, parse_tool_calls, render_assistant_calls
from keel.errors import UserError
from keel.types import ToolCall

PYTHON_TAG = "<|python_tag|>"  # Llama-3.1 may open a call with it


def parse_json_calls(text: str) -> list[ToolCall]:
    """Llama-3.1's custom-tool calls: the whole turn is a JSON object `{"name": ..., "parameters":
    {...}}` (after an optional <|python_tag|>), or several separated by ";". A turn that does not
    start with "{" makes no call (it is an answer). Never raises: a malformed call is a ToolCall
    with `error` set (`bad_json`, `bad_call`, `too_long`), and text after the last object is one
    more call with error `bad_json`.

    >>> [(c.name, c.arguments) for c in parse_json_calls('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')]
    [('f', {'x': 1}), ('g', {})]
    """
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return []
    if len(body) > MAX_CALL_CHARS:
        return [ToolCall(name="", arguments={}, raw=body[:MAX_CALL_CHARS], error="too_long")]
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except (json.JSONDecodeError, RecursionError, ValueError):
            return calls + [ToolCall(name="", arguments={}, raw=body[pos:], error="bad_json")]
        calls.append(parse_call_json(body[pos:end]))
        rest = body[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(body) - len(rest)
        if rest and not rest.startswith("{"):
            return calls + [ToolCall(name="", arguments={}, raw=rest, error="bad_json")]
    return calls


def render_json_calls(calls: list[dict[str, Any]]) -> str:
    """Gold assistant text in Llama-3.1's format, `{"name": ..., "parameters": {...}}`, "; " between calls."""
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False) for c in calls)


@dataclass(frozen=True)
class Family:
    """A tool-call format: how a turn ends, how its calls are read and written."""

    end_token: str
    parse: Callable[[str], list[ToolCall]]
    render_calls: Callable[[list[dict[str, Any]]], str]


# hermes: <tool_call> JSON (Qwen2.5, Hermes-2/3, Keel's own ChatML; Qwen3 writes it too, but its
# template is refused, module docstring). llama3: Llama-3.1/3.2 custom tools, bare JSON.
FAMILIES: dict[str, Family] = {
    "hermes": Family("<|im_end|>", parse_tool_calls, render_assistant_calls),
    "llama3": Family("<|eot_id|>", parse_json_calls, render_json_calls),
}


def detect_family(template: str, name: str) -> str:
    """The tool-call family a template writes: "hermes" when it shows <tool_call> tags, "llama3"
    when it asks for JSON with "parameters" between <|start_header_id|> headers."""
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and "parameters" in template:
        return "llama3"
    if "tools" not in template:
        raise UserError(f"{name}: its chat template has no tool support (it never reads `tools`); "
                        "Keel's built-in Hermes format renders tools for any tokenizer")
    raise UserError(f"{name}: its chat template renders tools in a format Keel cannot parse; "
                    f"known: {', '.join(FAMILIES)} (<tool_call> JSON, Llama-3.1 JSON with \"parameters\")")


def for_run(cfg, tokenizer) -> ChatTemplate | None:
    """The template a run renders with (`cfg` a keel.config.Config): None for
    model.chat_format=hermes (Keel's own layout, keel.chat); for `template`, the tokenizer's own
    (load it with keel.models.load_tokenizer(..., own_template=True)), refused with one line when
    the template cannot serve (from_tokenizer) or when the config needs the Hermes call family:
    env.kind=fc_learn parses calls with its own <tool_call> parser, and env.plan writes its plan
    as <think> before a <tool_call> block. keel.config.check_chat_format refuses the rest before."""
    if cfg.model.chat_format != "template":
        return None
    chat = ChatTemplate.from_tokenizer(tokenizer)
    if chat.family != "hermes":
        needs = [key for key, on in (("env.kind=fc_learn", cfg.env.kind == "fc_learn"), ("env.plan", cfg.env.plan)) if on]
        if needs:
            raise UserError(f"model.chat_format=template: {chat.name}'s template writes {chat.family} calls, but {needs[0]} "
                            "reads and writes Hermes <tool_call> calls; use a Hermes-family template (Qwen2.5) or model.chat_format=hermes")
    return chat


PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


@dataclass
class ChatTemplate:
    """A tokenizer's own chat template and its tool-call family (see the module docstring)."""

    tokenizer: Any
    family: str
    name: str

    @classmethod
    def from_tokenizer(cls, tokenizer, family: str = "auto") -> "ChatTemplate":
        """The tokenizer's template, its family detected from the template text unless given;
        refused (UserError) without a template, without tool support, or when the probe
        conversation shows that it re-renders earlier turns."""
        name = str(getattr(tokenizer, "name_or_path", "") or "") or "the tokenizer"
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template.strip():
            raise UserError(f"{name}: the tokenizer has no chat template")
        if family == "auto":
            family = detect_family(template, name)
        elif family not in FAMILIES:
            raise UserError(f"chat template family {family!r} is not one of {', '.join(FAMILIES)}")
        end = FAMILIES[family].end_token
        if tokenizer.encode(end, add_special_tokens=False) != [tokenizer.convert_tokens_to_ids(end)]:
            raise UserError(f"{name}: {end} is not one token of this tokenizer; the {family} family ends turns with it")
        chat = cls(tokenizer, family, name)
        chat.probe("</think>" in template)
        return chat

    @property
    def end_token(self) -> str:
        return FAMILIES[self.family].end_token

    @property
    def end_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.end_token)

    def parse(self, text: str) -> list[ToolCall]:
        return FAMILIES[self.family].parse(text)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return FAMILIES[self.family].render_calls(calls)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation: bool) -> str:
        """The template's text for `messages`; `generation` adds the assistant header."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation, tokenize=False)
        except TemplateError as e:
            raise UserError(f"{self.name}: its chat template failed on a {messages[-1]['role']} message: {' '.join(str(e).split())[:200]}") from None

    def encode(self, text: str) -> list[int]:
        """Template text to ids; special tokens written in the text (<|im_start|>) are parsed, none added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def start(self, system: str, tools: list[dict[str, Any]], user: str) -> "Conversation":
        """An episode's conversation, its `text` the prompt (system, user, assistant header)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return Conversation(self, tools, messages, self.render(messages, tools, generation=True))

    def probe(self, think: bool) -> None:
        """Render a short episode in the family's own format (a call, its result, an answer, a
        follow-up question, with a <think> block in each turn when the template knows one);
        raise when the template re-renders a turn once another is added."""
        opening = "<think>\nprobe\n</think>\n\n" if think else ""
        conversation = self.start("Probe instructions.", [PROBE_TOOL], "Probe question?")
        steps = [(self.render_calls([{"name": "probe", "arguments": {"x": "a"}}]), {"role": "tool", "content": "probe result"}),
                 ("probe answer", {"role": "user", "content": "Probe follow-up?"})]
        for text, message in steps:
            conversation.add_turn(opening + text)
            if conversation.extend([message]) is None:
                raise UserError(f"{self.name}: its chat template does not render an assistant turn in its own "
                                f"{self.family} format as written ({opening + text!r}); Keel cannot append to the sampled tokens")


@dataclass
class Conversation:
    """One episode as the template sees it (`messages`) and as the policy has seen it (`text`).

    Worked example (ChatML): after `start`, text = "<|im_start|>system\\n...<|im_end|>\\n
    <|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\n"; `add_turn("<tool_call>...</tool_call>")`
    appends the turn and "<|im_end|>"; `extend([tool message])` returns "\\n<|im_start|>user\\n
    <tool_response>\\nR\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n" and appends it.
    """

    chat: ChatTemplate
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    text: str
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # characters of each assistant turn in `text`

    def add_turn(self, content: str) -> None:
        """A sampled assistant turn that ended with the end-of-turn token (`content` without it)."""
        start = len(self.text)
        self.text += content + self.chat.end_token
        self.turn_spans.append((start, len(self.text)))
        self.messages.append({"role": "assistant", "content": content})

    def respond(self, content: str, results: list[str], next_user: str | None) -> str | None:
        """`add_turn(content)`, then `extend` with what answered it: one tool message per call
        result, or (a turn without calls) the environment's next user message."""
        self.add_turn(content)
        if results:
            return self.extend([{"role": "tool", "content": result} for result in results])
        return self.extend([{"role": "user", "content": next_user or ""}])

    def extend(self, messages: list[dict[str, Any]]) -> str | None:
        """The text to append after the last assistant turn for `messages` (tool results or a user
        message), ending with the next assistant header; None when the template does not render
        that turn as the model wrote it (the episode ends). Raises UserError when the template
        changes what it rendered before (module docstring)."""
        after = self.chat.render(self.messages + messages, self.tools, generation=True)
        if not after.startswith(self.text):
            first = len(os.path.commonprefix([after, self.text]))
            start = self.turn_spans[-1][0] if self.turn_spans else len(self.text)
            as_last = self.chat.render(self.messages, self.tools, generation=False)
            if first < start or as_last.startswith(self.text):
                raise UserError(self._changed(first, after, messages))
            return None
        delta = after[len(self.text) :]
        self.messages.extend(messages)
        self.text = after
        return delta

    def _changed(self, first: int, after: str, messages: list[dict[str, Any]]) -> str:
        where = "the prompt"
        for k, (start, end) in enumerate(self.turn_spans, 1):
            if first >= start:
                where = f"assistant turn {k}" if first < end else f"what follows assistant turn {k}"
        added = " and ".join(sorted({"a tool response" if m["role"] == "tool" else f"a {m['role']} message" for m in messages}))
        return (f"{self.chat.name}: its chat template renders {where} differently once {added} is added "
                f"(at character {first}, {self.text[max(0, first - 12):first + 28]!r} became {after[max(0, first - 12):first + 28]!r}); Keel appends to "
                "the sampled tokens and never re-renders them, so it needs a template that keeps earlier turns as written "
                "(Keel's built-in Hermes format does)")
