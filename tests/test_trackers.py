"""Trackers: the report_to setting, missing packages, and every tracker writing the same metric
names, read back from its own files (TensorBoard events, W&B offline run file, trackio's
SQLite store, MLflow's file store).

Versions used: tensorboard 2.21.0, wandb 0.31.0, trackio 0.43.0, mlflow-skinny 3.17.2.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from keel import trackers
from keel.chat import CONTROL_TAGS
from keel.trackers import Tracker, TrackerUnavailable, make_tracker, mlflow_key, mlflow_name, parse_report_to, scalar_metrics

# Three logged lines as the trainer would pass them: slash names, control-tag suffixes, a
# string phase, a NaN (dropped everywhere), and an eval line at a step of its own.
LINES = [
    (1, {"step": 1, "phase": "rl", "reward/mean": 0.25, "kl/tag/<|im_end|>": 0.5, "kl/tag/</tool_call>": 0.125, "loss/policy": float("nan")}),
    (2, {"step": 2, "phase": "rl", "reward/mean": 0.75, "kl/tag/<|im_end|>": 1.5, "kl/tag/</tool_call>": 0.25, "tools/per_question": 3}),
    (3, {"step": 3, "phase": "eval", "eval/em": 0.375, "eval/cvt": 0.0625}),
]
# name → {step: value}; every value is exact in float32, so TensorBoard's storage is lossless.
EXPECTED = {
    "reward/mean": {1: 0.25, 2: 0.75},
    "kl/tag/<|im_end|>": {1: 0.5, 2: 1.5},
    "kl/tag/</tool_call>": {1: 0.125, 2: 0.25},
    "tools/per_question": {2: 3.0},
    "eval/em": {3: 0.375},
    "eval/cvt": {3: 0.0625},
}


def log_lines(tracker: Tracker) -> None:
    for step, metrics in LINES:
        tracker.log(step, metrics)
    tracker.close()


# ---------------------------------------------------------------------------------------------
# Setting and plumbing
# ---------------------------------------------------------------------------------------------


def test_parse_report_to():
    assert parse_report_to(None) == [] and parse_report_to([]) == []
    assert parse_report_to(["jsonl"]) == []  # always on; nothing extra to start
    assert parse_report_to("TensorBoard, wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match=r"report_to: unknown tracker 'wandbb' \(choose from jsonl, tensorboard, wandb, trackio, mlflow\)"):
        parse_report_to(["wandbb"])
    with pytest.raises(ValueError, match="must be strings"):
        parse_report_to([3])


def test_scalar_metrics_worked_example():
    got = scalar_metrics({"step": 3, "phase": "rl", "loss/kl": 0.1, "loss/policy": float("nan"), "x/inf": float("inf"), "ok": True, "note": "text"})
    assert got == {"loss/kl": 0.1, "ok": 1.0}


def test_mlflow_key_by_hand_and_round_trip():
    # '<' = 0x3C, '|' = 0x7C, '>' = 0x3E; '/', '_' are allowed as they are.
    assert mlflow_key("kl/tag/<|im_end|>") == "kl/tag/:3C:7Cim_end:7C:3E"
    assert mlflow_key("eval/em") == "eval/em"
    assert mlflow_key("a:b") == "a:3Ab"  # the escape character itself is escaped
    assert mlflow_key("x→y") == "x:E2:86:92y"  # '→' is three UTF-8 bytes
    allowed = re.compile(r"^[/\w.\- :]*$")  # MLflow's rule for metric names
    for name in [f"kl/tag/{t}" for t in CONTROL_TAGS] + ["tokens/freq/é", "a:3C", "odd name: 100%"]:
        assert allowed.match(mlflow_key(name)), name
        assert mlflow_name(mlflow_key(name)) == name


def test_missing_package_fails_at_construction_with_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(TrackerUnavailable) as info:
        make_tracker(["tensorboard", "wandb"], tmp_path / "run")
    message = str(info.value)
    assert message == "report_to includes 'wandb' but the package 'wandb' is not installed: pip install wandb==0.31.0"
    assert "\n" not in message
    assert not (tmp_path / "run" / "tensorboard").exists()  # checked before anything started


def test_a_package_with_a_missing_dependency_is_named_as_broken(monkeypatch):
    def fake_import(name):
        raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")

    monkeypatch.setattr(trackers.importlib, "import_module", fake_import)
    with pytest.raises(TrackerUnavailable, match=r"^report_to includes 'mlflow' but 'mlflow' failed to import \(ModuleNotFoundError: No module named 'pydantic'\): pip install mlflow-skinny==3.17.2$"):
        trackers.require("mlflow")


def test_a_failing_tracker_is_switched_off_and_the_others_go_on(capsys):
    class Recorder:
        def __init__(self):
            self.seen, self.closed = [], False

        def log(self, step, scalars):
            self.seen.append((step, scalars))

        def close(self):
            self.closed = True

    class Broken(Recorder):
        def log(self, step, scalars):
            raise OSError("disk full")

    good, bad = Recorder(), Broken()
    tracker = Tracker({"good": good, "bad": bad})
    tracker.log(1, {"a": 1.0})
    tracker.log(2, {"a": 2.0, "phase": "rl"})
    tracker.log(3, {"phase": "eval"})  # nothing plottable: not forwarded
    assert good.seen == [(1, {"a": 1.0}), (2, {"a": 2.0})]
    assert tracker.names == ["good"] and bad.closed
    assert tracker.failures == {"bad": "OSError: disk full"}
    assert capsys.readouterr().err.count("tracker 'bad' failed and is switched off") == 1
    with pytest.raises(TypeError, match="step must be an int"):
        tracker.log("3", {"a": 1.0})
    tracker.close()
    assert good.closed and tracker.names == []


# ---------------------------------------------------------------------------------------------
# Each tracker writes the same names (read back from its own files)
# ---------------------------------------------------------------------------------------------


def test_tensorboard_writes_the_metric_names(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installable here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_lines(make_tracker(["tensorboard"], tmp_path))
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    got = {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}
    assert got == EXPECTED


def read_wandb_records(path: Path) -> list[bytes]:
    """Records of a W&B `.wandb` file: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of (crc32 u32, length u16, type u8) chunks, LevelDB-log style (1 full, 2 first,
    3 middle, 4 last); a block tail shorter than a chunk header is padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    return records


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline by default (no WANDB_MODE), and W&B's settings/cache folders inside tmp_path."""
    for variable in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def test_wandb_offline_writes_the_metric_names(tmp_path, wandb_env):
    pytest.importorskip("wandb", reason="wandb not installable here")
    from wandb.proto import wandb_internal_pb2

    tracker = make_tracker(["wandb"], tmp_path, config={"lr": 1e-6})
    assert tracker.backends["wandb"]._run.settings.mode == "offline"
    log_lines(tracker)
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    got: dict[str, dict[int, float]] = {}
    for raw in read_wandb_records(Path(run_file)):
        record = wandb_internal_pb2.Record.FromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
        step = items.pop("_step")
        for key, value in items.items():
            if not key.startswith("_"):  # W&B's own _runtime, _timestamp
                got.setdefault(key, {})[step] = value
    assert got == EXPECTED


TRACKIO_CHILD = """
import json, sys
from keel.trackers import make_tracker
lines = json.loads(sys.argv[2])
tracker = make_tracker(["trackio"], sys.argv[1], run_name="fake")
for step, metrics in lines:
    tracker.log(step, metrics)
tracker.close()
"""


def test_trackio_writes_the_metric_names(tmp_path):
    pytest.importorskip("trackio", reason="trackio not installable here")
    # trackio fixes its storage folder when first imported: a fresh process, as in training.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_"))}
    env["HF_HOME"] = str(tmp_path / "hf")  # where trackio would go if TRACKIO_DIR were not set
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    lines = json.dumps([(s, {k: (v if v == v else None) for k, v in m.items()}) for s, m in LINES])
    done = subprocess.run([sys.executable, "-c", TRACKIO_CHILD, str(tmp_path), lines], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    database = tmp_path / "trackio" / "keel.db"
    assert database.is_file(), sorted(p.name for p in tmp_path.rglob("*"))
    got: dict[str, dict[int, float]] = {}
    with sqlite3.connect(database) as connection:
        for step, metrics in connection.execute("select step, metrics from metrics where run_name = 'fake'"):
            for key, value in json.loads(metrics).items():
                got.setdefault(key, {})[step] = value
    assert got == EXPECTED


def test_mlflow_file_store_writes_the_metric_names(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow not installable here")
    log_lines(make_tracker(["mlflow"], tmp_path, config={"optim": {"lr": 1e-6}, "report_to": ["mlflow"]}))
    # File store layout: mlruns/<experiment id>/<run id>/metrics/<key as a path>, one
    # "timestamp value step" line per logged point.
    (run,) = [p for p in (tmp_path / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
    got: dict[str, dict[int, float]] = {}
    for file in (run / "metrics").rglob("*"):
        if file.is_file():
            name = mlflow_name(file.relative_to(run / "metrics").as_posix())
            for line in file.read_text().splitlines():
                _, value, step = line.split()
                got.setdefault(name, {})[int(step)] = float(value)
    assert got == EXPECTED
    assert (run / "params" / "optim.lr").read_text() == "1e-06"


def test_every_tracker_at_once(tmp_path, wandb_env):
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module, reason=f"{module} not installable here")
    tracker = make_tracker("tensorboard,wandb,mlflow,jsonl", tmp_path)
    assert tracker.names == ["tensorboard", "wandb", "mlflow"]
    log_lines(tracker)
    assert tracker.failures == {}
    assert trackers.BACKENDS.keys() == trackers.PACKAGES.keys()
