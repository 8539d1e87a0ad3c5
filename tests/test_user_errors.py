"""Issue 17: every user error is one line `keel: error: ...` with exit status 2 and leaves no
directory it did not have before; one process owns a run directory; a corrupt checkpoint falls
back to `.old` or says what to do; resume and verdicts on edge cases. The tables run the real
CLI; none of them trains (they fail before a step), except the module's one finished smoke run."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runs import free_port

REPO = Path(__file__).resolve().parent.parent
KEEL = [sys.executable, "-m", "keel.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FAST = ["--set", "run.progress=false"]


def keel(*args, timeout=300, cwd=REPO):
    return subprocess.run([*KEEL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV)


def assert_one_line_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("keel: error: "), last
    for fragment in fragments:
        assert fragment in last, last
    return last


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file under root with its bytes' size, mtime and content hash: "changes nothing".
    The lock file is left out: it marks who owns the directory (a refused resume of a run made
    before lock files existed leaves an unlocked one)."""
    import hashlib

    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.name == ".keel.lock":
            continue
        st = p.stat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else None)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from keel.types import Task

    d = tmp_path_factory.mktemp("inputs")
    (d / "kb.tsv").write_text("m.film\tfilm.film.directed_by\tm.bob\nm.bob\ttype.object.name\tBob\n")
    (d / "empty_kb.tsv").write_text("")
    (d / "latin1_kb.tsv").write_bytes("m.film\tfilm.film.directed_by\tCafé\n".encode("latin-1"))
    (d / "binary_kb.tsv").write_bytes(bytes(range(256)) * 16)
    tasks = [Task(id=f"q{i}", question=f"Who directed m.film ({i})?", answers=["Bob"], topic_entities={"m.film": "m.film"},
                  gold_turns=[[{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}]])
             for i in range(3)]
    (d / "q.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in tasks))
    (d / "latin1_q.jsonl").write_bytes((json.dumps(tasks[0].to_dict(), ensure_ascii=False).replace("Who", "Qui é") + "\n").encode("latin-1"))
    (d / "binary_q.jsonl").write_bytes(b"\x00\x01\x02\xff\xfe" * 400)
    (d / "a_file").write_text("not a directory\n")
    (d / "latin1_tasks.jsonl").write_bytes('{"prompt": "Combien de clients à Lyon ?", "answer": "3"}\n'.encode("latin-1"))
    (d / "binary_tasks.jsonl").write_bytes(bytes(range(256)) * 16)
    (d / "latin1_tools.json").write_bytes('[{"name": "run_sql", "description": "Exécute"}]'.encode("latin-1"))
    (d / "binary_tools.json").write_bytes(b"\x00\x01\x02\xff\xfe" * 400)
    (d / "deep_tools.json").write_text("[" * 100_000)
    (d / "latin1_traj.jsonl").write_bytes('{"task_id": "café"}\n'.encode("latin-1"))
    (d / "not_traj.jsonl").write_text('{"task_id": "q0"}\n')
    return d


def _files(kb: str, train: str = "q.jsonl") -> list[str]:
    return ["--set", "data.source=files", "--set", f"data.kb=DIR/{kb}", "--set", f"data.train=DIR/{train}", "--set", "data.dev=DIR/q.jsonl"]


def _tools(train: str = "examples/sql_tools/train.jsonl", schema: str = "") -> list[str]:
    tools = ["env.tools_file=", f"env.tools_schema={schema}", "env.dispatcher=examples/sql_tools/dispatch.py:dispatch"] if schema \
        else ["env.tools_file=examples/sql_tools/tools.py"]
    sets = ["env.kind=tools", *tools, "data.source=jsonl", f"data.train={train}", "data.dev=examples/sql_tools/dev.jsonl"]
    return [a for kv in sets for a in ("--set", kv)]


TRAIN_ERRORS = [
    (_files("latin1_kb.tsv"), "latin1_kb.tsv is not UTF-8 text"),
    (_files("binary_kb.tsv"), "binary_kb.tsv is not UTF-8 text"),
    (_files("kb.tsv", "latin1_q.jsonl"), "latin1_q.jsonl is not UTF-8 text"),
    (_files("kb.tsv", "binary_q.jsonl"), "binary_q.jsonl"),
    (_files("empty_kb.tsv"), "empty_kb.tsv holds no triples"),
    (_tools(train="DIR/latin1_tasks.jsonl"), "latin1_tasks.jsonl is not UTF-8 text"),
    (_tools(train="DIR/binary_tasks.jsonl"), "binary_tasks.jsonl is not UTF-8 text"),
    (_tools(schema="DIR/latin1_tools.json"), "latin1_tools.json is not UTF-8 text"),
    (_tools(schema="DIR/binary_tools.json"), "binary_tools.json is not UTF-8 text"),
    (_tools(schema="DIR/deep_tools.json"), "deep_tools.json: not JSON"),
    (["--set", "signals.self_distill.trajectories=DIR/latin1_traj.jsonl"], "latin1_traj.jsonl: not UTF-8 text"),
    (["--set", "signals.self_distill.trajectories=DIR/not_traj.jsonl"], "not_traj.jsonl:1: not a trajectory"),
    (["--set", "grpo.lr=nan"], "grpo.lr must be a finite number"),
    (["--set", "grpo.lr=-1"], "grpo.lr must be > 0"),
    (["--set", "sft.lr=inf"], "sft.lr must be a finite number"),
    (["--set", "eval.n_dev=0"], "eval.n_dev must be ≥ 1"),
    (["--set", "rollout.group_size=1"], "rollout.group_size=1: GRPO's advantage"),
    (["--set", "rollout.max_total_tokens=-5"], "rollout.max_total_tokens must be ≥ 2"),
    (["--set", "signals.hint.enabled=true", "--set", "signals.hint.kinds=[bogus]"], "signals.hint.kinds: unknown hint kind(s) ['bogus']"),
    (["--set", "report_to=[tensorbored]"], "report_to: unknown tracker 'tensorbored'"),
    (["--set", "model.name=/tmp"], "model.name: /tmp is not a Hugging Face model directory"),
    (["--set", "model.name=/nonexistent/model"], "model.name: '/nonexistent/model' is neither"),
]


@pytest.mark.parametrize("args, message", TRAIN_ERRORS, ids=[m for _, m in TRAIN_ERRORS])
def test_bad_train_input_is_one_line_and_leaves_no_directory(tmp_path, inputs, args, message):
    out = tmp_path / "parent" / "run"  # its parent does not exist either: neither may be left behind
    r = keel("train", "configs/smoke.yaml", *[a.replace("DIR", str(inputs)) for a in args], *FAST, "--out", out)
    assert_one_line_error(r, message)
    assert not (tmp_path / "parent").exists()


def test_out_that_is_a_file_is_refused_and_untouched(tmp_path, inputs):
    target = tmp_path / "a_file"
    shutil.copy(inputs / "a_file", target)
    for args in (["train", "configs/smoke.yaml", *FAST], ["eval", "--env", "kg", "--data", inputs / "q.jsonl", "--kb", inputs / "kb.tsv", "--policy", "oracle"]):
        r = keel(*args, "--out", target)
        assert_one_line_error(r, str(target), "exists and is not a directory")
        assert target.read_text() == "not a directory\n"


class _Server:
    """A chat-completions server that answers every request with (status, body)."""

    def __init__(self, status: int, body: str):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("case", ["nothing listening", "HTTP 500", "not JSON", "binary questions", "latin-1 KB", "empty KB",
                                  "policy not found", "policy not a model"])
def test_bad_eval_input_is_one_line_and_leaves_no_directory(tmp_path, inputs, case):
    out = tmp_path / "ev"
    data = ["--data", inputs / "q.jsonl", "--kb", inputs / "kb.tsv"]
    server = None
    if case in ("HTTP 500", "not JSON"):
        server = _Server(500, '{"error": {"message": "boom"}}') if case == "HTTP 500" else _Server(200, "<html>hello</html>")
    url = server.url if server else f"http://127.0.0.1:{free_port()}/v1"
    endpoint = ["--policy", "endpoint", "--base-url", url, "--endpoint-model", "m", "--retries", "1", "--backoff", "0.01", "--timeout", "5"]
    args, message = {
        "nothing listening": (data + endpoint, f"{url}/chat/completions: cannot connect"),
        "HTTP 500": (data + endpoint, f"{url}/chat/completions: HTTP 500"),
        "not JSON": (data + endpoint, "response is not a chat completion"),
        "binary questions": (["--data", inputs / "binary_q.jsonl", "--kb", inputs / "kb.tsv", "--policy", "oracle"], "binary_q.jsonl"),
        "latin-1 KB": (["--data", inputs / "q.jsonl", "--kb", inputs / "latin1_kb.tsv", "--policy", "oracle"], "latin1_kb.tsv is not UTF-8"),
        "empty KB": (["--data", inputs / "q.jsonl", "--kb", inputs / "empty_kb.tsv", "--policy", "oracle"], "holds no triples"),
        "policy not found": (data + ["--policy", "/nonexistent/model"], "--policy: '/nonexistent/model'"),
        "policy not a model": (data + ["--policy", str(tmp_path)], "is not a Hugging Face model directory"),
    }[case]
    try:
        r = keel("eval", "--env", "kg", *args, "--out", out)
    finally:
        if server:
            server.close()
    last = assert_one_line_error(r, message)
    assert "model.name" not in last  # eval's own flag is named, not the training config's key
    assert not out.exists()


@pytest.mark.parametrize("case", ["policy not found", "policy not a model"])
def test_config_eval_names_policy_and_leaves_no_directory(tmp_path, capsys, case):
    from keel.cli import main

    (tmp_path / "not_a_model").mkdir()
    policy = {"policy not found": "/nonexistent/model", "policy not a model": str(tmp_path / "not_a_model")}[case]
    out = tmp_path / "ev"
    assert main(["eval", "--config", "configs/smoke.yaml", "--policy", policy, "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"keel: error: --policy: {policy if case == 'policy not a model' else repr(policy)}"), last
    assert "model.name" not in last and not out.exists()


def test_data_check_of_an_empty_kb_fails(inputs):
    r = keel("data", "check", "--data", inputs / "q.jsonl", "--kb", inputs / "empty_kb.tsv")
    assert_one_line_error(r, "empty_kb.tsv holds no triples")


# ---------------------------------------------------------------------------------------------
# in-process: a full disk, before and during a run
# ---------------------------------------------------------------------------------------------
def test_a_tiny_filesystem_is_refused_before_any_directory_exists(tmp_path, monkeypatch, capsys):
    import keel.rundir
    from keel.cli import main

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(keel.rundir.shutil, "disk_usage", lambda p: usage(2 << 20, 0, 2 << 20))
    out = tmp_path / "a" / "b" / "run"
    assert main(["train", "configs/smoke.yaml", *FAST, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("keel: error: run directory") and "only 2 MB free" in err[-1]
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("kept", [False, True], ids=["first write", "after a metrics line"])
def test_disk_full_mid_write_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, kept):
    """ENOSPC on the run's first write (config.yaml): nothing is left. On a later one (after a
    metrics line): the run directory is kept, since what it logged can be resumed."""
    import keel.rundir
    from keel.cli import main

    real = os.fsync
    out = tmp_path / "run"

    def fsync(fd):
        metrics = out / "metrics.jsonl"
        if out.exists() and (not kept or metrics.exists() and metrics.read_text().strip()):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(keel.rundir.os, "fsync", fsync)
    assert main(["train", "configs/smoke.yaml", *FAST, "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"keel: error: {out}/") and "No space left on device" in last and "--resume" in last, last
    assert out.exists() == kept
    if kept:
        assert (out / "metrics.jsonl").read_text().strip()


# ---------------------------------------------------------------------------------------------
# The CLI's catch: user errors by type (subclasses included), bugs keep their traceback
# ---------------------------------------------------------------------------------------------
def test_cli_catch_is_by_type_not_by_exact_class(monkeypatch, capsys):
    import keel.cli
    from keel.config import ConfigError

    class Sub(ConfigError):
        pass

    def raise_(exc):
        def command(args):
            raise exc
        return command

    monkeypatch.setitem(keel.cli.COMMANDS, "report", raise_(Sub("a subclass\nsecond line")))
    assert keel.cli.main(["report", "x"]) == 2
    assert capsys.readouterr().err == "keel: error: a subclass\n"
    monkeypatch.setitem(keel.cli.COMMANDS, "report", raise_(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bug")))
    with pytest.raises(UnicodeDecodeError):  # a decoding error Keel did not turn into a UserError is a bug
        keel.cli.main(["report", "x"])
    monkeypatch.setitem(keel.cli.COMMANDS, "report", raise_(ValueError("internal")))
    with pytest.raises(ValueError):
        keel.cli.main(["report", "x"])


# ---------------------------------------------------------------------------------------------
# Run directory ownership
# ---------------------------------------------------------------------------------------------
def test_claim_refuses_and_discard_deletes_only_what_it_created(tmp_path):
    from keel.rundir import LOCK_FILE, RunDirError, claim_run_dir, lock_run_dir

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("1")
    with pytest.raises(RunDirError, match="already exists and is not empty"):
        claim_run_dir(tmp_path / "full")
    lock = claim_run_dir(tmp_path / "new" / "deeper" / "run")
    with pytest.raises(RunDirError, match=rf"in use by another keel process \(pid {os.getpid()}\)"):
        lock_run_dir(tmp_path / "new" / "deeper" / "run")  # a second owner, even in this process (a new file description)
    (lock.path / "config.yaml").write_text("x")
    lock.discard()
    assert not (tmp_path / "new").exists()  # the run and the parents it made
    (tmp_path / "empty").mkdir()
    lock = claim_run_dir(tmp_path / "empty")
    (lock.path / "config.yaml").write_text("x")
    lock.discard_if_fresh()
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())  # it existed: kept, emptied
    lock = claim_run_dir(tmp_path / "kept")
    (lock.path / "metrics.jsonl").write_text('{"step": 1}\n')
    lock.discard_if_fresh()
    assert (tmp_path / "kept" / "metrics.jsonl").exists() and (tmp_path / "kept" / LOCK_FILE).exists()
    lock_run_dir(tmp_path / "kept").release()  # released: the next owner gets it


_HOLDER = r"""
import sys, time
from keel.rundir import claim_run_dir, lock_run_dir
from pathlib import Path
lock = (lock_run_dir if sys.argv[2] == "existing" else claim_run_dir)(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def _hold(path: Path, kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), kind], cwd=REPO, stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished smoke run (2 SFT + 2 GRPO steps) and its stderr; tests copy it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = keel("train", "configs/smoke.yaml", *FAST, "--out", run)
    assert r.returncode == 0, r.stderr[-3000:]
    return run, r


def _copy(finished, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    (run / ".keel.lock").unlink(missing_ok=True)
    return run


def test_a_directory_held_by_another_process_is_refused_untouched(finished, tmp_path):
    run = _copy(finished, tmp_path)
    holder = _hold(run, "existing")
    try:
        before = snapshot(run)
        r = keel("train", "--resume", run, "--set", "grpo.steps=3")
        assert_one_line_error(r, f"run directory {run} is in use by another keel process (pid {holder.pid})")
        assert snapshot(run) == before  # not config.yaml, not the checkpoint, not the metrics
    finally:
        holder.kill()
        holder.wait()
    empty = tmp_path / "empty"
    holder = _hold(empty, "new")  # a new run's directory, still empty but for its lock
    try:
        r = keel("train", "configs/smoke.yaml", *FAST, "--out", empty)
        assert_one_line_error(r, "in use by another keel process")
        assert [p.name for p in empty.iterdir()] == [".keel.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_two_processes_started_on_one_directory_one_trains_the_other_changes_nothing(tmp_path):
    out = tmp_path / "run"
    cmd = [*KEEL, "train", "configs/smoke.yaml", *FAST, "--set", "sft.steps=1", "--set", "grpo.steps=1", "--set", "eval.before_sft=false",
           "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    results = [(p.returncode, p.communicate(timeout=600)[1]) for p in procs]
    results = [(p.returncode, err) for p, (_, err) in zip(procs, results)]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert loser.strip().splitlines()[-1].startswith(f"keel: error: run directory {out}") and "Traceback" not in loser
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["phase"]) for x in lines] == [(1, "sft"), (1, "eval"), (2, "rl")]  # one run's lines, once each
    assert (out / "config.yaml").exists() and json.loads((out / "summary.json").read_text())["phase"] == "done"


# ---------------------------------------------------------------------------------------------
# Resume edge cases and corrupt checkpoints
# ---------------------------------------------------------------------------------------------
def test_the_finished_run_is_readable_and_quiet(finished):
    run, r = finished
    assert "Writing model shards" not in r.stderr and "it/s" not in r.stderr  # run.progress=false: no bars at all
    for name in ("config.yaml", "summary.json", "metrics.jsonl", "eval/step_000004.jsonl", "checkpoints/latest/trainer_state.json"):
        assert (run / name).stat().st_mode & 0o777 == 0o666 & ~_umask(), name  # not mkstemp's 0600


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_resume_of_a_finished_run_changes_nothing(finished, tmp_path):
    run = _copy(finished, tmp_path)
    before = snapshot(run)
    r = keel("train", "--resume", run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "is finished" in r.stdout and "--set grpo.steps=N" in r.stdout
    assert snapshot(run) == before  # summary.json and its wall_time_s untouched


def test_resume_with_more_steps_writes_them_to_config_yaml(finished, tmp_path):
    from keel.config import load_config

    run = _copy(finished, tmp_path)
    r = keel("train", "--resume", run, "--set", "grpo.steps=3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_config(run / "config.yaml").grpo.steps == 3  # a later plain --resume continues to 3, not 2
    assert json.loads((run / "summary.json").read_text())["grpo_steps_done"] == 3


@pytest.mark.parametrize("damage, with_old", [("truncated weights", False), ("invalid trainer_state.json", False),
                                              ("truncated optimizer", False), ("invalid trainer_state.json", True)])
def test_corrupt_latest_checkpoint_falls_back_to_old_or_says_what_to_do(finished, tmp_path, damage, with_old):
    run = _copy(finished, tmp_path)
    latest = run / "checkpoints" / "latest"
    if with_old:
        shutil.copytree(latest, latest.with_name("latest.old"))
    target = {"truncated weights": "model.safetensors", "invalid trainer_state.json": "trainer_state.json",
              "truncated optimizer": "optimizer.pt"}[damage]
    data = (latest / target).read_bytes()
    (latest / target).write_bytes(data[: len(data) // 2] if "truncated" in damage else b'{"progress": ')
    before = snapshot(run)
    r = keel("train", "--resume", run, "--set", "grpo.steps=3")
    if with_old:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "resuming from latest.old" in r.stdout and (latest.with_name("latest.corrupt") / target).exists()
        return
    assert_one_line_error(r, f"checkpoint {latest} is corrupt", target, f"delete {latest}", f"keel train --resume {run}")
    assert snapshot(run) == before  # config.yaml still says grpo.steps=2


# ---------------------------------------------------------------------------------------------
# Verdicts on nothing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["diagnose", "report"])
@pytest.mark.parametrize("content", ["empty", "config only"])
def test_diagnose_and_report_refuse_a_run_with_nothing_logged(tmp_path, capsys, command, content):
    from keel.cli import main

    run = tmp_path / "run"
    run.mkdir()
    if content == "config only":
        (run / "config.yaml").write_text("model:\n  name: tiny\n")
    before = snapshot(run)
    assert main([command, str(run)]) == 2
    assert capsys.readouterr().err.startswith(f"keel: error: {command}: {run}")
    assert snapshot(run) == before  # no diagnosis.json, no report.html


def test_compare_refuses_runs_whose_same_ids_are_different_questions(tmp_path, capsys):
    from keel.cli import main

    for name, salt in (("a", "x"), ("b", "y")):
        (tmp_path / name / "eval").mkdir(parents=True)
        rows = [{"task_id": f"q{i}", "em": float(i % 2), "f1": 0.0, "format_valid": 1.0, "question_hash": f"{salt}{i}"} for i in range(4)]
        (tmp_path / name / "eval" / "step_000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error: compare:") and "share question ids but not questions (4 of 4" in err
    rows = (tmp_path / "a" / "eval" / "step_000001.jsonl").read_text()
    (tmp_path / "b" / "eval" / "step_000001.jsonl").write_text(rows)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0  # the same questions: compared


def test_eval_records_carry_the_question_hash():
    from keel.evaluate import question_hash
    from keel.types import Task

    a = Task(id="q1", question="Who?", answers=["Bob"])
    assert question_hash(a) == question_hash(Task(id="other", question="Who?", answers=["Bob"]))
    assert question_hash(a) != question_hash(Task(id="q1", question="Who?", answers=["Ann"]))
    assert question_hash(a) != question_hash(Task(id="q1", question="Where?", answers=["Bob"]))


# ---------------------------------------------------------------------------------------------
# Over-long inputs
# ---------------------------------------------------------------------------------------------
def test_a_one_megabyte_question_is_read_and_then_dropped_with_a_count(tmp_path, capsys):
    from keel.kg.env import KGEnv
    from keel.kg.loaders import load_store, load_tasks
    from keel.models import load_tokenizer
    from keel.tasks import drop_overlong
    from keel.types import Task

    big = Task(id="big", question="x " * 500_000, answers=["a"])
    small = Task(id="small", question="Who directed m.film?", answers=["Bob"])
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(big.to_dict()) + "\n" + json.dumps(small.to_dict()) + "\n")
    tasks = load_tasks(path)  # format detection reads the whole first line (1 MB): one JSON record, keel format
    assert [t.id for t in tasks] == ["big", "small"]
    (tmp_path / "kb.tsv").write_text("m.film\tfilm.film.directed_by\tm.bob\n")
    kept, dropped = drop_overlong(tasks, load_tokenizer("tiny"), KGEnv(load_store(tmp_path / "kb.tsv")), 1000)
    assert [t.id for t in kept] == ["small"] and dropped == 1


@pytest.mark.parametrize("source", ["keel question file", "tools tasks file"])
def test_train_drops_a_one_megabyte_question_with_a_counted_warning_and_goes_on(tmp_path, inputs, source):
    """Through the real CLI: the 1 MB question is read, dropped before the run directory exists
    with the warning that counts it, and the run trains on the others to the end."""
    if source == "keel question file":
        from keel.types import Task

        big = Task(id="big", question="Who directed m.film? " + "x " * 500_000, answers=["Bob"], topic_entities={"m.film": "m.film"},
                   gold_turns=[[{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": "film.film.directed_by"}}]])
        train = tmp_path / "train.jsonl"
        train.write_text(json.dumps(big.to_dict()) + "\n" + (inputs / "q.jsonl").read_text())
        args = ["configs/smoke.yaml", "--set", "data.source=files", "--set", f"data.kb={inputs / 'kb.tsv'}", "--set", f"data.train={train}",
                "--set", f"data.dev={inputs / 'q.jsonl'}"]
    else:
        lines = (REPO / "examples/sql_tools/train.jsonl").read_text().splitlines()
        big = {**json.loads(lines[0]), "prompt": "How many orders did Nia Berg place? " + "x " * 500_000, "id": "big"}
        train = tmp_path / "train.jsonl"
        train.write_text(json.dumps(big) + "\n" + "\n".join(lines[:8]) + "\n")
        args = ["examples/sql_tools/preset.yaml", "--smoke", *_tools(train=str(train))]
    assert train.stat().st_size > 1_000_000
    out = tmp_path / "run"
    r = keel("train", *args, *FAST, "--set", "sft.steps=1", "--set", "grpo.steps=1",
             "--set", "eval.before_sft=false", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[keel] warning: dropped 1 training and 0 dev questions whose prompt is longer than" in r.stdout, r.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "done" and summary["grpo_steps_done"] == 1


# ---------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------
def test_sigterm_sets_the_flag_and_a_second_signal_aborts():
    import signal

    from keel.errors import Aborted
    from keel.run import Interrupted

    with Interrupted() as interrupted:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert interrupted.flag and interrupted.signal_name == "SIGTERM"
        with pytest.raises(Aborted) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert info.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


_TERMINATED_WHILE = r"""
import os, signal, sys, time
import keel.tasks, keel.trackers
module, name = {"loading data": (keel.tasks, "prepare"), "setting up the run": (keel.trackers, "make_tracker")}[sys.argv[1]]
real = getattr(module, name)

def terminated(*args, **kwargs):  # `kill` arrives while this runs
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    return real(*args, **kwargs)

setattr(module, name, terminated)
from keel.cli import main
sys.exit(main(["train", "configs/smoke.yaml", "--set", "run.progress=false", "--out", sys.argv[2]]))
"""


@pytest.mark.parametrize("moment", ["loading data", "setting up the run"])
def test_sigterm_before_the_run_s_handler_cleans_up_as_sigint_does(tmp_path, moment):
    """SIGTERM before keel.train.Interrupted is installed (preflight; or after the directory is
    claimed and config.yaml written, before training starts): unwound as Ctrl-C is there, so
    nothing is left behind, and exit 143."""
    out = tmp_path / "parent" / "run"
    r = subprocess.run([sys.executable, "-c", _TERMINATED_WHILE, moment, str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=ENV)
    assert r.returncode == 143, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == "keel: interrupted (SIGTERM)" and "Traceback" not in r.stderr
    assert not (tmp_path / "parent").exists()
