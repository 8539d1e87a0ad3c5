"""`rollout.dtype: auto` and `model.autocast: auto`: bf16 only where the device multiplies bf16
natively (keel.models.native_bf16), decided when the run starts, recorded in summary.json."""

import json

import pytest
import torch
import yaml

from keel import models
from keel.config import Config, ConfigError, load_config
from keel.run import resolve_precision
from runs import train_cli


def _auto() -> Config:
    cfg = Config()
    cfg.rollout.dtype, cfg.model.autocast = "auto", "auto"
    return cfg


@pytest.mark.parametrize("native, dtype, autocast, words", [(True, "bfloat16", True, "multiplies bf16 natively"),
                                                           (False, "float32", False, "no native bf16 matmul")])
def test_auto_follows_the_device(monkeypatch, native, dtype, autocast, words):
    monkeypatch.setattr("keel.run.native_bf16", lambda device: native)
    cfg = _auto()
    got, said = resolve_precision(cfg, "cpu")
    assert (got.rollout.dtype, got.model.autocast) == (dtype, autocast)
    assert words in said and "rollout.dtype and model.autocast auto" in said
    assert (cfg.rollout.dtype, cfg.model.autocast) == ("auto", "auto")  # the caller's config (config.yaml's) keeps auto


def test_explicit_settings_are_never_changed(monkeypatch):
    monkeypatch.setattr("keel.run.native_bf16", lambda device: False)
    cfg = Config()
    cfg.rollout.dtype, cfg.model.autocast = "bfloat16", True
    got, said = resolve_precision(cfg, "cpu")
    assert got is cfg and said == "" and (got.rollout.dtype, got.model.autocast) == ("bfloat16", True)
    cfg.rollout.dtype = "auto"  # one auto key: only it is decided
    got, said = resolve_precision(cfg, "cpu")
    assert (got.rollout.dtype, got.model.autocast) == ("float32", True) and said.startswith("rollout.dtype auto")


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert models.native_bf16("cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(models.platform, "machine", lambda: "x86_64")
    assert not models.native_bf16("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert models.native_bf16("cpu")
    assert not models.native_bf16("mps")


@pytest.mark.parametrize("override", ["model.autocast=maybe", "model.autocast=1", "rollout.dtype=half"])
def test_precision_values_are_checked(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key):
        load_config("configs/smoke.yaml", [override])


def test_a_run_records_what_auto_decided(tmp_path):
    out = train_cli(tmp_path, "run", "configs/smoke.yaml", "--set", "rollout.dtype=auto", "--set", "model.autocast=auto")
    native = models.native_bf16("cpu")  # the run's machine is this one
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == {"rollout.dtype": "bfloat16" if native else "float32", "model.autocast": native}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["rollout"]["dtype"], saved["model"]["autocast"]) == ("auto", "auto")
