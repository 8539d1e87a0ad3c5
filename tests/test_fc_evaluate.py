"""evaluate_fc: output files, BFCL aggregate formulas by hand, ID/OOD splits, the learnable task."""

from __future__ import annotations

import json

import pytest

from keel.fc.bfcl import BfclEpisode
from keel.fc.evaluate import bfcl_aggregates, evaluate_fc, resolve_policy
from keel.fc.learnable import LearnableEnv, generate_tasks
from keel.fc.policies import make_oracle, run_fc_episode


def test_bfcl_aggregates_by_hand():
    acc = {
        "multi_turn_base": 1.0, "multi_turn_miss_func": 0.5, "multi_turn_miss_param": 0.5, "multi_turn_long_context": 0.0,
        "simple_python": 0.9, "multiple": 0.8, "parallel": 0.6, "parallel_multiple": 0.4,
        "live_simple": 1.0, "live_multiple": 0.5, "irrelevance": 1.0, "live_irrelevance": 0.5,
    }
    counts = {"live_simple": 100, "live_multiple": 300}
    out = bfcl_aggregates(acc, counts)
    assert out["overall/multi_turn"] == pytest.approx(0.5)  # (1 + .5 + .5 + 0) / 4
    # simple = (0.9 + 0 java + 0 javascript) / 3 = 0.3; non-live = (0.3 + .8 + .6 + .4) / 4 = 0.525
    assert out["overall/non_live"] == pytest.approx(0.525)
    # live, weighted by count: (1.0*100 + 0.5*300) / 400 = 0.625 (the parallel parts have count 0)
    assert out["overall/live"] == pytest.approx(0.625)
    assert out["overall/irrelevance"] == pytest.approx(0.75)
    # V3 overall = (0.625 + 0.525 + 0.5) / 3 = 0.55
    assert out["overall/bfcl_v3"] == pytest.approx(0.55)
    assert bfcl_aggregates({"multi_turn_base": 1.0}, {}) == {"overall/multi_turn": 0.25}


def test_evaluate_writes_summary_and_results(tmp_path):
    s = evaluate_fc("bfcl", "oracle", categories=["base", "miss_param"], limit=5, out_dir=tmp_path, call_formats=("json", "python"), heldout_classes=("TwitterAPI",))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == s
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 20  # 2 categories x 5 entries x 2 formats
    assert s["accuracy/multi_turn_base"] == 1.0 and s["format_ood/python/accuracy/multi_turn_miss_param"] == 1.0
    # multi_turn overall counts the two categories not run as 0: (1 + 1 + 0 + 0) / 4
    assert s["overall/multi_turn"] == 0.5
    ood_ids = {r["id"] for r in rows if r["content_split"] == "ood"}
    assert s["content_ood/num_tasks"] == len(ood_ids) and s["content_id/num_tasks"] == 10 - len(ood_ids)
    assert all(0.0 <= v <= 1.0 for k, v in s.items() if k.startswith("accuracy/"))


def test_unknown_inputs_fail_clearly():
    with pytest.raises(ValueError, match="unknown policy 'gpt'"):
        resolve_policy("gpt", "json")
    with pytest.raises(ValueError, match="unknown env"):
        evaluate_fc("kg", "oracle", data=[])
    with pytest.raises(ValueError, match="unknown BFCL category"):
        evaluate_fc("bfcl", "oracle", categories=["memory_kv"])


def test_learnable_tasks_are_seeded_and_scored_by_the_bfcl_checker():
    a, b = generate_tasks(30, seed=7), generate_tasks(30, seed=7)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert [t.id for t in generate_tasks(30, seed=8)] != [t.id for t in a] or [t.gold_turns for t in generate_tasks(30, seed=8)] != [t.gold_turns for t in a]
    env = LearnableEnv("json")
    assert all(run_fc_episode(env, t, make_oracle("json"), 20)[1]["checker_valid"] for t in a)
    assert {len(t.meta["entry"]["function"]) for t in a} <= {3, 5}

    # A wrong number gets reward 0 from bfcl-eval's checker (state and result differ).
    math = next(t for t in a if t.kind == "fc_learn_math")
    wrong = [[dict(c, arguments={**c["arguments"], "a": c["arguments"]["a"] + 1}) for c in turn] for turn in math.gold_turns]
    bad = math.__class__.from_dict({**math.to_dict(), "gold_turns": wrong})
    _, info = run_fc_episode(env, bad, make_oracle("json"), 20)
    assert info["checker_valid"] is False


def test_learnable_second_turn_needs_the_first_result():
    tasks = [t for t in generate_tasks(40, seed=0, kinds=("math",)) if len(t.gold_turns) == 2]
    t = tasks[0]
    first = t.gold_turns[0][0]
    ops = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b}
    carried = ops[first["name"]](first["arguments"]["a"], first["arguments"]["b"])
    assert t.gold_turns[1][0]["arguments"]["a"] == carried
    ep = BfclEpisode(t)
    assert ep.next_user_message().startswith("Now multiply that result by")
    ep.close()


def test_evaluate_fc_learn_oracle(tmp_path):
    s = evaluate_fc("fc_learn", "oracle", limit=20, out_dir=tmp_path)
    assert s["accuracy/fc_learn_math"] == 1.0 and s["accuracy/fc_learn_fs"] == 1.0


def test_evaluate_fc_reports_progress_per_task():
    lines = []
    evaluate_fc("fc_learn", "null", limit=2, call_formats=("json", "python"), progress=lines.append)
    assert lines == ["json 1/2 tasks, 0 valid", "json 2/2 tasks, 0 valid", "python 1/2 tasks, 0 valid", "python 2/2 tasks, 0 valid"]
    lines.clear()
    evaluate_fc("fc_learn", "oracle", limit=3, progress=lines.append)
    assert lines == ["json 1/3 tasks, 1 valid", "json 2/3 tasks, 2 valid", "json 3/3 tasks, 3 valid"]


def test_fc_learn_train_classes_and_call_format_from_the_config():
    """Paper A's claim 3 axes from a preset: data.fc_train_classes keeps the training tasks to
    some classes and leaves dev whole (the rest is content-OOD); env.call_format writes the
    prompt, the parser and the gold trajectories in another format (format-OOD)."""
    from keel import tasks as task_builder
    from keel.config import ConfigError, load_config
    from keel.sft import gold_texts

    base = load_config("configs/fc_smoke.yaml")
    env, train, dev = task_builder.build(base, None)
    assert (len(train), [t.kind for t in dev], env.call_format) == (16, ["fc_learn_math", "fc_learn_fs"] * 2, "json")

    cfg = load_config("configs/fc_smoke.yaml", ["data.fc_train_classes=[MathAPI]", "env.call_format=python"])
    env, train, dev = task_builder.build(cfg, None)
    # generate_tasks alternates math and fs: 8 of the first 16 are math; dev is the same 4 tasks
    assert [t.id for t in train] == [t.id for t in task_builder.build(base, None)[1] if t.kind == "fc_learn_math"] and len(train) == 8
    assert [t.kind for t in dev] == ["fc_learn_math", "fc_learn_fs"] * 2 and env.call_format == "python"
    call = train[0].gold_turns[0][0]
    assert gold_texts(train[0], env)[0] == f"[{call['name']}(a={call['arguments']['a']}, b={call['arguments']['b']})]"
    assert all(run_fc_episode(env, t, make_oracle("python"), 20)[1]["checker_valid"] for t in dev)

    with pytest.raises(task_builder.DataError, match=r"data.fc_train_classes: \['TravelAPI'\] are not fc_learn classes \(known: MathAPI, GorillaFileSystem\)"):
        task_builder.build(load_config("configs/fc_smoke.yaml", ["data.fc_train_classes=[TravelAPI]"]), None)
    with pytest.raises(ConfigError, match="env.call_format must be one of json, python, python_tagged, got 'xml'"):
        load_config("configs/fc_smoke.yaml", ["env.call_format=xml"])
    with pytest.raises(ConfigError, match="env.call_format=python is for env.kind=fc_learn; env.kind=kg writes calls as Hermes JSON"):
        load_config("configs/smoke.yaml", ["env.call_format=python"])
    with pytest.raises(ConfigError, match="data.fc_train_classes selects fc_learn's API classes; env.kind=kg has none"):
        load_config("configs/smoke.yaml", ["data.fc_train_classes=[MathAPI]"])


def _padded_to(ids: list[int], n: int, filler: int) -> list[int]:
    assert len(ids) <= n
    return ids + [filler] * (n - len(ids))


@pytest.mark.parametrize("on_cut", ["continue", "stop"])
def test_a_cut_turn_is_closed_and_parsed_under_on_cut_continue(tiny, on_cut):
    """fc_learn's gold turns forced into a tiny model's rollout; the first turn is forced to
    exactly max_new_tokens ids without <|im_end|> (cut). "continue": the turn is closed with
    <|im_end|>, its calls run, the episode goes on and BFCL's checker accepts it, as the oracle's
    episode; "stop" (training's rule): the episode ends truncated there and the checker refuses it."""
    from keel.chat import IM_END
    from keel.rollout import SamplingParams, rollout
    from keel.sft import gold_turn_texts

    model, tok = tiny
    eos = tok.convert_tokens_to_ids(IM_END)
    newline = tok.encode("\n", add_special_tokens=False)[0]
    task = generate_tasks(4, seed=0)[0]
    texts = gold_turn_texts(task)
    assert len(texts) >= 2
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(len(x) for x in ids) + 1
    forced = [_padded_to(ids[0], width, newline)] + [x + [eos] for x in ids[1:]]
    params = SamplingParams(greedy=True, max_turns=len(texts) + 2, max_new_tokens=width, max_total_tokens=4096, on_cut=on_cut)
    tr = rollout(model, tok, LearnableEnv("json"), [task], params, steer=lambda row, turn: forced[turn] if turn < len(forced) else None)[0]
    oracle = run_fc_episode(LearnableEnv("json"), task, make_oracle("json"), 10)[1]
    assert oracle["checker_valid"]
    first_end = tr.turn_spans[0][1]
    assert tr.token_ids[tr.turn_spans[0][0]:first_end] == forced[0]  # the cut turn: no <|im_end|> sampled
    if on_cut == "stop":
        assert tr.truncated and len(tr.turn_texts) == 1 and not tr.info["checker_valid"] and "cut_turns" not in tr.info
        return
    assert tr.token_ids[first_end] == eos  # closed by the engine, not by the policy
    assert tr.sources[first_end] != tr.sources[first_end - 1]
    assert tr.info["cut_turns"] == 1 and tr.finished and not tr.truncated
    assert tr.turn_texts == [texts[0] + "\n" * (width - len(ids[0]))] + texts[1:]
    assert tr.info["checker_valid"] is True


def test_model_policy_scores_as_the_text_path_on_the_same_turns(tiny, tmp_path):
    """evaluate_fc with a ModelPolicy (batched rollouts, cut turns continued, per-task turn
    limits) against the text path given the very turns the model produced: the same rows, the
    same summary, and a conversation that decodes to the text path's rendering of it. And the
    first turn equals what the re-encoding model policy (keel.evaluate.model_text_policy)
    writes: both paths start from the same prompt."""
    from keel.chat import render_conversation
    from keel.evaluate import model_text_policy
    from keel.fc.evaluate import ModelPolicy, env_for

    model, tok = tiny
    tasks = generate_tasks(5, seed=3)
    policy = ModelPolicy(model, tok, max_new_tokens=6, batch_size=2)
    batched = evaluate_fc("fc_learn", policy, data=tasks, out_dir=tmp_path / "batched")
    batches = policy.batches("fc_learn", tasks, "json")
    assert sorted(i for b in batches for i in b) == list(range(len(tasks))) and all(len(b) <= 2 for b in batches)
    assert all(len({tuple(tasks[i].meta["involved_classes"]) for i in b}) == 1 for b in batches)  # one API class set a batch
    assert len({tuple(t.meta["involved_classes"]) for t in tasks}) == 2 and batches != [[0, 1], [2, 3], [4]]  # so the order changed
    trajs = {t.id: tr for batch in policy.run("fc_learn", tasks, "json") for _, t, tr in batch}
    assert all(tr.info.get("cut_turns", 0) >= 1 for tr in trajs.values())  # a random model never ends a turn itself

    def replay(task, messages):
        return trajs[task.id].turn_texts[sum(m["role"] == "assistant" for m in messages)]

    text = evaluate_fc("fc_learn", replay, data=tasks, out_dir=tmp_path / "text")
    assert batched == text
    assert (tmp_path / "batched" / "results.jsonl").read_text() == (tmp_path / "text" / "results.jsonl").read_text()
    for task in tasks:
        episode, _ = run_fc_episode(env_for("fc_learn", task, "json"), task, replay, 100)
        tools = env_for("fc_learn", task, "json").tools(task)
        rendered = render_conversation(episode.messages, tools)
        decoded = tok.decode(trajs[task.id].token_ids, skip_special_tokens=False)
        assert rendered.startswith(decoded)  # the text path's conversation continues where the batched one stopped
        first = model_text_policy(model, tok, lambda t: tools, 6)(task, episode.messages[:2])
        assert first == trajs[task.id].turn_texts[0]


def test_model_policy_refuses_bad_sizes(tiny):
    from keel.fc.evaluate import ModelPolicy

    with pytest.raises(ValueError, match="batch_size and max_new_tokens must be ≥ 1"):
        ModelPolicy(*tiny, batch_size=0)
