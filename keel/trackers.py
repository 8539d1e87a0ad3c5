"""One `report_to` setting → one Tracker that forwards each metrics line to optional external
trackers (TensorBoard, Weights & Biases offline, trackio, MLflow), under the same names.

The local `metrics.jsonl` is the record of a run and the trainer writes it itself; trackers
are a convenience for people who watch runs in those tools. So a missing package fails at
construction (before any step is spent), but a tracker that breaks mid-run is switched off
with a one-line warning instead of killing a long run. Departures from each tool's usual
path: TensorBoard events are written with the `tensorboard` package's own writer (torch's
SummaryWriter rewrites tags such as `kl/tag/<|im_end|>` to `kl/tag/__im_end__`), and MLflow,
which forbids `<`, `|` and `>` in names, gets a reversible escape (see `mlflow_key`).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from keel.errors import UserError


# report_to name → (module to import, pip requirement that provides it; the versions tested)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard==2.21.0"),
    "wandb": ("wandb", "wandb==0.31.0"),
    "trackio": ("trackio", "trackio==0.43.0"),
    "mlflow": ("mlflow", "mlflow-skinny==3.17.2"),
}
LOCAL = "jsonl"  # always on (written by the trainer); accepted in report_to for clarity
CHOICES = (LOCAL, *PACKAGES)


class TrackerUnavailable(UserError, RuntimeError):
    """A tracker named in report_to cannot be used (its package is missing or broken)."""


def require(name: str) -> Any:
    """Import the package behind tracker `name`, or raise a one-line TrackerUnavailable."""
    module, requirement = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing in (None, module) or (missing and missing.split(".")[0] == module):
            raise TrackerUnavailable(f"report_to includes '{name}' but the package '{module}' is not installed: pip install {requirement}") from None
        raise TrackerUnavailable(f"report_to includes '{name}' but '{module}' failed to import ({type(exc).__name__}: {exc}): pip install {requirement}") from None


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The plottable part of a metrics line: finite numbers (bools as 0/1), without `step`
    and `phase`. NaN/inf stay in metrics.jsonl only: trackio and MLflow reject them, and one
    name set across all trackers matters more than the non-finite point.

    Worked example: {"step": 3, "phase": "rl", "loss/kl": 0.1, "loss/policy": nan, "ok": True}
    → {"loss/kl": 0.1, "ok": 1.0}.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in ("step", "phase") or not isinstance(key, str):
            continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def parse_report_to(report_to: str | Iterable[str] | None) -> list[str]:
    """Normalise the setting: None/[] → []; "tensorboard,wandb" or a list → names in order,
    without duplicates and without the always-on "jsonl". Unknown names raise ValueError."""
    if report_to is None:
        return []
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"report_to: tracker names must be strings, got {item!r}")
        name = item.strip().lower()
        if not name:
            continue
        if name not in CHOICES:
            raise ValueError(f"report_to: unknown tracker '{item}' (choose from {', '.join(CHOICES)})")
        if name != LOCAL and name not in names:
            names.append(name)
    return names


# ----------------------------------------------------------------------------------------------
# Backends: each has log(step, scalars) and close()
# ----------------------------------------------------------------------------------------------


class TensorBoardTracker:
    """Event files under run_dir/tensorboard/, one Event per log call, tags = metric names."""

    def __init__(self, run_dir: Path, config: dict | None, run_name: str, project: str):
        require("tensorboard")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = run_dir / "tensorboard"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.directory))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run in offline mode under run_dir/wandb/ (sync later with `wandb sync`).

    WANDB_MODE set by the user (e.g. "online") is respected; otherwise the mode is offline,
    so nothing is sent anywhere.
    """

    def __init__(self, run_dir: Path, config: dict | None, run_name: str, project: str):
        wandb = require("wandb")
        mode = os.environ.get("WANDB_MODE", "offline")
        # console="off": W&B would otherwise wrap stdout/stderr of the whole trainer.
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False)
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode, config=config or {}, settings=settings, reinit="create_new")
        self.directory = Path(self._run.dir).parent

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
        # finish() can return before W&B's service process has written the run file (seen
        # here: 1 run in 3 left only the 7-byte header); teardown waits for it. W&B runs it at
        # exit too, but not reliably under multiprocessing (its docs), i.e. under accelerate.
        self._wandb.teardown()


def point_trackio_at(run_dir: Path) -> None:
    """Set TRACKIO_DIR to run_dir/trackio if trackio has not been imported yet (it reads the
    variable once, at import)."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(run_dir / "trackio")


class TrackioTracker:
    """A trackio run in the local SQLite store run_dir/trackio/<project>.db.

    trackio reads its folder from TRACKIO_DIR once, when first imported; if it was imported
    earlier in this process with another folder, the data goes there (`directory` says where).
    """

    def __init__(self, run_dir: Path, config: dict | None, run_name: str, project: str):
        point_trackio_at(run_dir)
        trackio = require("trackio")
        from trackio import utils as trackio_utils

        self.directory = Path(trackio_utils.TRACKIO_DIR)
        if self.directory != run_dir / "trackio":
            print(f"keel: trackio was imported earlier in this process; its data goes to {self.directory}", file=sys.stderr)
        self._trackio = trackio
        self._run = trackio.init(project=project, name=run_name, config=config or {}, resume="allow", embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


_MLFLOW_ALLOWED = re.compile(r"[\w/.\- ]")  # MLflow allows these and ':', which is our escape


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts, reversibly: each other character becomes ':' and two hex
    digits per UTF-8 byte. "kl/tag/<|im_end|>" → "kl/tag/:3C:7Cim_end:7C:3E"."""
    return "".join(c if _MLFLOW_ALLOWED.fullmatch(c) else "".join(f":{b:02X}" for b in c.encode("utf-8")) for c in name)


def mlflow_name(key: str) -> str:
    """Inverse of mlflow_key."""
    out = bytearray()
    i = 0
    while i < len(key):
        if key[i] == ":" and re.fullmatch(r"[0-9A-F]{2}", key[i + 1 : i + 3]):
            out.append(int(key[i + 1 : i + 3], 16))
            i += 3
        else:
            out += key[i].encode("utf-8")
            i += 1
    return out.decode("utf-8")


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = str(v)[:6000]  # MLflow's limit on a parameter value
    return flat


class MlflowTracker:
    """An MLflow run in a file store under run_dir/mlruns/ (open with
    `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri run_dir/mlruns`).

    MLflow 3 keeps the file store in maintenance mode behind MLFLOW_ALLOW_FILE_STORE; a file
    store keeps the run inside its directory with no database package, so Keel opts in.
    """

    def __init__(self, run_dir: Path, config: dict | None, run_name: str, project: str):
        require("mlflow")
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.directory = run_dir / "mlruns"
        self._client = MlflowClient(tracking_uri=self.directory.resolve().as_uri())
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
        self._run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(mlflow_key(k), v) for k, v in _flatten(config or {}).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self._run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


BACKENDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker, "mlflow": MlflowTracker}


# ----------------------------------------------------------------------------------------------
# The one object the trainer holds
# ----------------------------------------------------------------------------------------------


class Tracker:
    """Forwards `log(step, metrics)` to every configured backend; `close()` once at the end.

    A backend that raises while logging is closed and dropped with one warning on stderr
    (`failures` keeps the reason): metrics.jsonl is the record, a tracker is a view of it.
    """

    def __init__(self, backends: dict[str, Any]):
        self.backends = dict(backends)
        self.failures: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return list(self.backends)

    def _drop(self, name: str, exc: BaseException) -> None:
        self.failures[name] = f"{type(exc).__name__}: {exc}"
        print(f"keel: tracker '{name}' failed and is switched off ({self.failures[name]}); metrics.jsonl is unaffected", file=sys.stderr)
        backend = self.backends.pop(name)
        try:
            backend.close()
        except Exception:  # already failing; the warning above is the report
            pass

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"Tracker.log: step must be an int, got {step!r}")
        scalars = scalar_metrics(metrics)
        if not scalars:
            return
        for name, backend in list(self.backends.items()):
            try:
                backend.log(step, scalars)
            except Exception as exc:  # a tracker must not end a training run
                self._drop(name, exc)

    def close(self) -> None:
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as exc:
                self.failures[name] = f"{type(exc).__name__}: {exc}"
                print(f"keel: tracker '{name}' failed to close ({self.failures[name]})", file=sys.stderr)
        self.backends = {}

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_tracker(
    report_to: str | Iterable[str] | None,
    run_dir: str | os.PathLike,
    *,
    config: dict | None = None,
    run_name: str | None = None,
    project: str = "keel",
) -> Tracker:
    """Build the Tracker for a `report_to` setting, e.g. ["tensorboard", "mlflow"].

    Every package is checked before any backend starts, so a missing one raises
    TrackerUnavailable (one line, with the pip command) and leaves nothing half-created.
    Call on the main process only under multi-process training.
    """
    names = parse_report_to(report_to)
    directory = Path(run_dir)
    if "trackio" in names:
        point_trackio_at(directory)  # before the import below
    for name in names:
        require(name)
    directory.mkdir(parents=True, exist_ok=True)
    label = run_name or directory.resolve().name
    backends: dict[str, Any] = {}
    try:
        for name in names:
            backends[name] = BACKENDS[name](directory, config, label, project)
    except BaseException:
        Tracker(backends).close()
        raise
    return Tracker(backends)
