"""The real `keel` CLI: the smoke preset end to end, and one-line errors for bad input."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import deterministic_lines

REPO = Path(__file__).resolve().parent.parent
KEEL = [sys.executable, "-m", "keel.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def keel(*args, timeout=300):
    return subprocess.run([*KEEL, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_smoke_preset_runs_the_whole_loop_under_60s(tmp_path):
    out = tmp_path / "run"
    t0 = time.time()
    r = keel("train", "configs/smoke.yaml", "--out", str(out))
    elapsed = time.time() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    assert elapsed < 60, f"smoke run took {elapsed:.1f}s"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "report.html"):
        assert (out / name).exists(), name
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    phases = [x["phase"] for x in lines]
    assert phases.count("sft") == 2 and phases.count("rl") == 2 and "eval" in phases
    rl = [x for x in lines if x["phase"] == "rl"]
    for key in ("reward/mean", "reward/std", "loss/policy", "loss/kl", "kl/mean", "tools/per_question", "rollout/tokens_per_s"):
        assert key in rl[0], key
    assert "eval/em" in rl[-1] and "eval/format_valid" in rl[-1] and "eval/tools_per_question" in rl[-1]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_before_sft", "eval_after_sft", "eval_final", "wall_time_s"):
        assert key in summary
    # the RL phase's lift: final eval vs post-SFT eval on the same questions, said in words on the console
    assert summary["rl_lift/n"] == 2 and summary["rl_lift/gained"] + summary["rl_lift/lost"] <= 2
    assert abs(summary["rl_lift/em"] - (summary["eval_final"]["eval/em"] - summary["eval_after_sft"]["eval/em"])) < 1e-9
    assert "RL lifted dev EM" in r.stdout and "McNemar p=" in r.stdout
    assert (out / "checkpoints" / "latest" / "model.safetensors").exists()
    assert (out / "checkpoints" / "latest" / "trainer_state.json").exists()
    assert list((out / "samples").glob("step_*.jsonl")) and list((out / "eval").glob("step_*.jsonl"))
    # the resolved config is complete and reloads to the same values
    from keel.config import load_config

    cfg = load_config(out / "config.yaml")
    assert cfg.model.name == "tiny" and cfg.grpo.steps == 2


def test_rl_from_a_checkpoint_reports_its_lift_against_the_first_eval(tmp_path):
    # no SFT phase: the pre-RL evaluation (eval.before_sft) is what the final one is paired with
    out = tmp_path / "run"
    r = keel("train", "configs/smoke.yaml", "--out", str(out), "--set", "sft.enabled=false", "--set", "eval.before_sft=true")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "eval_after_sft" not in summary and summary["eval_before_sft_step"] == 0
    assert summary["rl_lift/n"] == 2
    assert abs(summary["rl_lift/em"] - (summary["eval_final"]["eval/em"] - summary["eval_before_sft"]["eval/em"])) < 1e-9
    assert "RL lifted dev EM" in r.stdout


@pytest.mark.parametrize("sft_templates", [None, "[spouse,director_birthplace]"])
def test_rl_templates_the_warm_start_sees_every_question_rl_and_the_evals_only_theirs(tmp_path, sft_templates):
    out = tmp_path / "run"
    narrow = ["--set", f"data.sft_templates={sft_templates}"] if sft_templates else []
    r = keel("train", "configs/smoke.yaml", "--out", str(out), "--set", "data.kinds=[composition]",
             "--set", "data.templates=[birthplace_country,director_birthplace,spouse]",
             "--set", "data.rl_templates=[birthplace_country,director_birthplace]", "--set", "sft.packed=true", *narrow)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    templates = {}
    for name in ("train", "dev"):
        for line in (out / "data" / f"{name}.jsonl").read_text().splitlines():
            q = json.loads(line)
            templates[q["id"]] = q["meta"]["template"]
    train_templates = [t for i, t in templates.items() if "-train-" in i]
    assert len(train_templates) == 16 and "birthplace_country" in train_templates  # so the narrowed warm-start leaves some out
    warm = [t for t in train_templates if t in ("spouse", "director_birthplace")] if sft_templates else train_templates
    assert summary["n_sft"] == len(warm) and 0 < len(warm) <= 16 and (len(warm) < 16) == bool(sft_templates)  # SFT: data.sft_templates' questions (all by default), one packed example each
    assert summary["sft_examples"] == summary["n_sft"] - summary["sft_gold_failed"]
    assert summary["n_train"] == sum(t != "spouse" for t in train_templates) < 16  # RL: the two templates' only
    evaluated = {json.loads(x)["task_id"] for f in (out / "eval").glob("step_*.jsonl") for x in f.read_text().splitlines()}
    assert evaluated and {templates[i] for i in evaluated} <= {"birthplace_country", "director_birthplace"}


def test_the_eval_rl_starts_from_is_the_detectors_first_and_the_first_peak(tmp_path):
    # A cliff in RL's first eval window (post-SFT EM 0.60 → 0.00 two steps later, R-selfV at lr 6e-5)
    # went unseen while the detectors first met an eval at the first RL one.
    out = tmp_path / "run"
    r = keel("train", "configs/smoke.yaml", "--out", str(out), "--set", "run.progress=false")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    start, em = summary["eval_after_sft_step"], summary["eval_after_sft"]["eval/em"]
    state = json.loads((out / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["detectors"]["series"]["eval/em"][0] == [float(start), em]
    peak = json.loads((out / "checkpoints" / "peak" / "trainer_state.json").read_text())
    assert summary["peak"]["step"] == peak["step"] and summary["peak"]["eval/em"] >= em  # RL's start counts: never below it
    if summary["peak"]["eval/em"] == em:
        assert summary["peak"]["step"] == start  # no RL eval beat where RL started: a rollback goes there


def test_existing_run_directory_is_refused_and_untouched(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    r = keel("train", "configs/smoke.yaml", "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("keel: error: run directory") and "already exists" in r.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "configs/smoke.yaml", "--set", "grpo.klcoef=1"], "unknown config key 'grpo.klcoef'"),
        (["train", "configs/nosuch.yaml"], "config file not found"),
        (["train", "configs/smoke.yaml", "--set", "data.source=files", "--set", "data.kb=/nonexistent/kb.tsv", "--set", "data.train=/nonexistent/q.jsonl"], "data.kb: file not found"),
        (["train", "configs/smoke.yaml", "--set", "reward.name=nope"], "unknown reward 'nope'"),
        (["eval", "--env", "kg", "--data", "/nonexistent.jsonl", "--kb", "x", "--policy", "oracle", "--out", "OUT"], "--data not found"),
        (["eval", "--env", "bfcl", "--policy", "oracle", "--dtype", "bfloat16", "--out", "OUT"], "eval --dtype applies to a model policy, not --policy oracle"),
        (["eval", "--config", "configs/smoke.yaml", "--policy", "tiny", "--dtype", "bfloat16", "--out", "OUT"], "use --set model.dtype=bfloat16, not --dtype"),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_directory(tmp_path, args, message):
    out = tmp_path / "run"
    args = [a.replace("OUT", str(out)) for a in args]
    if args[0] == "train":
        args += ["--out", str(out)]
    r = keel(*args)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("keel: error:") and message in last, last
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_eval_oracle_and_null_on_pathquestion(tmp_path):
    data = REPO.parent / "shared" / "data" / "kg" / "pathquestion"
    if not data.exists():
        pytest.skip("shared PathQuestion data not present")
    r = keel("eval", "--env", "kg", "--data", str(data / "PQ-2H.txt"), "--kb", str(data / "2H-kb.txt"), "--policy", "oracle", "--limit", "200", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["eval/em"] == 1.0 and s["n"] == 200 and s["eval/tools_per_question"] >= 2.0  # 2 hops; a hop that branches costs more calls
    assert len((tmp_path / "o" / "results.jsonl").read_text().splitlines()) == 200
    r = keel("eval", "--env", "kg", "--data", str(data / "PQ-2H.txt"), "--kb", str(data / "2H-kb.txt"), "--policy", "null", "--limit", "50", "--out", str(tmp_path / "n"))
    s = json.loads((tmp_path / "n" / "summary.json").read_text())
    assert s["eval/em"] == 0.0 and s["eval/tools_per_question"] == 0.0


def test_data_generator_cli_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        r = keel("data", "kg-synth", "--out", str(d), "--seed", "7", "--train", "50", "--dev", "10", "--test", "10")
        assert r.returncode == 0, r.stderr[-2000:]
    for name in ("kb.tsv", "train.jsonl", "dev.jsonl", "test.jsonl", "meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    r = keel("data", "check", "--data", str(a))
    assert r.returncode == 0 and json.loads(r.stdout)["oracle"]["eval/em"] == 1.0


def test_help_explains_each_command():
    r = keel("--help")
    assert r.returncode == 0
    for cmd in ("train", "sweep", "eval", "data", "diagnose", "report", "compare"):
        assert cmd in r.stdout
    r = keel("train", "--help")
    assert "--smoke" in r.stdout and "--set" in r.stdout


def test_eval_endpoint_policy_against_a_loopback_chat_server(tmp_path):
    """Paper B's GPT-4o control: any OpenAI-compatible chat model through the same tool loop."""
    import http.server
    import threading

    data = REPO.parent / "shared" / "data" / "kg" / "pathquestion"
    if not data.exists():
        pytest.skip("shared PathQuestion data not present")
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            msgs = body["messages"]
            # first turn: call a tool; after a tool response: answer from it
            if msgs[-1]["role"] == "user" and "<tool_response>" in msgs[-1]["content"]:
                text = "<answer>united_kingdom</answer>"
            else:
                text = '<tool_call>\n{"name": "get_tail_relations", "arguments": {"entity": "frederica_of_mecklenburg-strelitz"}}\n</tool_call>'
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = keel("eval", "--env", "kg", "--data", str(data / "PQ-2H.txt"), "--kb", str(data / "2H-kb.txt"), "--policy", "endpoint",
                 "--base-url", f"http://127.0.0.1:{server.server_address[1]}/v1", "--endpoint-model", "gpt-4o", "--limit", "3",
                 "--out", str(tmp_path / "ep"))
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "ep" / "summary.json").read_text())
    assert s["eval/em"] == 1.0 and s["eval/tools_per_question"] == 1.0  # the first 3 PQ-2H questions share that answer
    assert seen[0]["model"] == "gpt-4o" and "get_tail_relations" in seen[0]["messages"][0]["content"]  # tools in the system message
    assert "errors" in s and s["errors"]["failed"] == 0


def test_eval_bfcl_with_a_model_runs_batched_rollouts_in_the_dtype_asked(tmp_path):
    """A model policy on BFCL's multi-turn tasks (the tiny random model: every turn cut at 4
    tokens, closed and parsed, the episode going on to the task's next user turn) in bf16."""
    r = keel("eval", "--env", "bfcl", "--policy", "tiny", "--categories", "multi_turn_base", "--limit", "3", "--max-new-tokens", "4",
             "--batch-size", "2", "--dtype", "bfloat16", "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["num_tasks"] == 3 and summary["accuracy/multi_turn_base"] == 0.0
    rows = [json.loads(x) for x in (tmp_path / "b" / "results.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == [f"multi_turn_base_{i}" for i in range(3)]
    assert all(row["assistant_turns"] >= 2 and not row["truncated"] for row in rows)  # every user turn was answered
    assert "json 2/3 tasks, 0 valid" in r.stderr and "json 3/3 tasks, 0 valid" in r.stderr


REWARD_LOG = '''import json, os


def flat(traj, task):
    """0 for every episode; logs the task ids it scores (one line per call)."""
    with open(os.environ["KEEL_TEST_REWARD_LOG"], "a") as f:
        f.write(task.id + "\\n")
    return 0.0, {}


CALLS = [0]


def alternate(traj, task):
    """1, 0, 1, 0, ... in the order episodes are scored (rows are grouped by prompt, groups of
    2 here): every group is mixed."""
    CALLS[0] += 1
    return float(CALLS[0] % 2), {}
'''


def test_a_step_with_no_mixed_group_redraws_its_batch(tmp_path):
    """grpo.redraw_flat: with a reward that is always 0, each step sets aside its batch and draws
    a fresh one, redraw_flat times (fresh prompts each time), then trains on nothing; with a
    reward that mixes every group, nothing is redrawn and every number is the run's without the
    option."""
    (tmp_path / "rewards_for_test.py").write_text(REWARD_LOG)
    log = tmp_path / "scored.txt"
    env = {**ENV, "KEEL_TEST_REWARD_LOG": str(log)}
    fn = str(tmp_path / "rewards_for_test.py")
    r = subprocess.run([*KEEL, "train", "configs/smoke.yaml", "--out", str(tmp_path / "flat"), "--set", "run.progress=false",
                        "--set", f"reward.name={fn}:flat", "--set", "grpo.redraw_flat=2"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rl = [x for x in map(json.loads, (tmp_path / "flat" / "metrics.jsonl").read_text().splitlines()) if x["phase"] == "rl"]
    assert [x["reward/redrawn_batches"] for x in rl] == [2, 2]
    assert all(x["loss/trained_members"] == 0 and x["reward/mixed_groups"] == 0 for x in rl)
    scored = log.read_text().split()
    # smoke: 2 steps × 3 batches × 2 prompts × 2 members, each batch of fresh training prompts
    train_ids = [t for t in scored if "-train-" in t]
    assert len(train_ids) == 2 * 3 * 2 * 2
    batches = [tuple(sorted(set(train_ids[i : i + 4]))) for i in range(0, len(train_ids), 4)]
    assert len(set(batches)) == 6 and all(len(b) == 2 for b in batches)
    # under the batch baseline a batch of uniform groups that differ from each other has advantages
    from keel.train import no_advantage

    assert no_advantage([[0.0, 0.0], [1.0, 1.0]], "group") and not no_advantage([[0.0, 0.0], [1.0, 1.0]], "batch")
    assert no_advantage([[1.0, 1.0], [1.0, 1.0]], "batch") and not no_advantage([[0.0, 1.0], [1.0, 1.0]], "group")

    runs = {}
    for name, extra in (("mixed", ["--set", "grpo.redraw_flat=3"]), ("plain", [])):
        r = keel("train", "configs/smoke.yaml", "--out", str(tmp_path / name), "--set", "run.progress=false",
                 "--set", f"reward.name={fn}:alternate", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = deterministic_lines(tmp_path / name)
    assert [x.pop("reward/redrawn_batches") for x in runs["mixed"] if x["phase"] == "rl"] == [0, 0]
    assert runs["mixed"] == runs["plain"]
    assert all(x["reward/mixed_groups"] > 0 for x in runs["plain"] if x["phase"] == "rl")
