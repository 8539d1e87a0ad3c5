"""Config tree: presets, typed overrides, one-line errors naming the key."""

import dataclasses
import re
from pathlib import Path

import pytest

from keel.config import Config, ConfigError, describe, get_key, leaves, load_config, set_key

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_and_override_types():
    cfg = load_config(None, ["grpo.lr=3e-6", "rollout.group_size=8", "grpo.scale_by_std=false", "grpo.clip_high=1"])
    assert cfg.grpo.lr == 3e-6 and cfg.rollout.group_size == 8 and cfg.grpo.scale_by_std is False
    assert isinstance(cfg.grpo.clip_high, float) and cfg.grpo.clip_high == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.klcoef=0.1", "unknown config key 'grpo.klcoef'"),
        ("nosuch.section=1", "unknown config key 'nosuch'"),
        ("rollout.group_size=two", "rollout.group_size' expects an integer"),
        ("grpo.scale_by_std=3", "grpo.scale_by_std' expects true/false"),
        ("grpo=1", "is a section"),
        ("grpo.kl_estimator=k2", "grpo.kl_estimator must be k1 or k3"),
        ("grpo.baseline=global", "grpo.baseline must be group or batch"),
        ("novalue", "not of the form key=value"),
    ],
)
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_preset_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("grpo:\n  learning_rate: 1.0e-6\n")
    with pytest.raises(ConfigError, match=r"unknown\.yaml: unknown config key 'grpo.learning_rate'"):
        load_config(unknown)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_loads_and_smoke_shrinks_it(preset):
    cfg = load_config(CONFIGS / preset)
    smoke = load_config(CONFIGS / preset, smoke=True)
    assert smoke.model.name == "tiny" and smoke.grpo.steps <= 2 and smoke.rollout.prompts_per_step <= 2
    assert cfg.grpo.steps >= smoke.grpo.steps
    assert (smoke.grpo.steps == 0) == (cfg.grpo.steps == 0)  # an SFT-only preset (claim3_fc_sft) stays SFT-only


def test_preset_by_name_and_describe():
    assert load_config("smoke").model.name == "tiny"
    text = describe()
    assert "grpo.kl_coef" in text and "coefficient of the KL" in text


def every_field(obj, prefix=""):
    """(dotted key, field) for every field of the tree, sections and their fields alike."""
    for f in dataclasses.fields(obj):
        yield prefix + f.name, f
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from every_field(value, f"{prefix}{f.name}.")


def test_every_config_key_has_help_and_describe_prints_it():
    keys = dict(every_field(Config()))
    assert len(keys) > 150 and "detectors.kl_spike.min_relative_scale" in keys and "signals.hint.kinds" in keys
    undocumented = [k for k, f in keys.items() if not f.metadata.get("help", "").strip()]
    assert undocumented == []
    text = describe()
    for key, f in keys.items():
        assert key in text and f.metadata["help"] in text, key


def test_reward_name_help_names_every_builtin_reward():
    # `--help-config` is where a user finds the switch for rung 3 as the paper ran it
    # (`reward.name=r_stepwise_released`), so every key of REWARDS is named there, whole.
    from keel.rewards import REWARDS

    help_text = dict(every_field(Config()))["reward.name"].metadata["help"]
    missing = [name for name in REWARDS if not re.search(rf"\b{name}\b", help_text)]
    assert missing == []


def test_one_walker_gets_and_sets_dotted_keys():
    cfg = Config()
    set_key(cfg, "detectors.cliff.drop", 1)  # an int where a float is declared: stored as 1.0
    assert get_key(cfg, "detectors.cliff.drop") == 1.0 and isinstance(cfg.detectors.cliff.drop, float)
    assert get_key(cfg, "signals.hint") is cfg.signals.hint
    with pytest.raises(ConfigError, match=r"unknown config key 'signals.hnit' \(in 'signals.hnit.kinds'\)"):
        get_key(cfg, "signals.hnit.kinds")
    flat = leaves(cfg)  # a dict-typed field is one leaf, a section is none
    assert flat["detectors.kl_spike.on_rollback"] == {"grpo.kl_coef": "x5"} and "signals.hint" not in flat
    assert all(get_key(cfg, key) == value for key, value in flat.items())


def test_batch_baseline_refuses_ops():
    with pytest.raises(ConfigError, match="grpo.baseline: batch does not combine with signals.ops"):
        load_config(None, ["grpo.baseline=batch", "signals.ops.enabled=true"])
    assert load_config(None, ["grpo.baseline=batch"]).grpo.baseline == "batch"


def test_an_unknown_nested_key_names_the_file_once(tmp_path):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("detectors:\n  kl_spike:\n    zz: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(unknown)
    assert str(e.value).count(str(unknown)) == 1 and "detectors.kl_spike.zz" in str(e.value)


def test_presets_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("smoke", "smoke.yaml", "configs/smoke.yaml"):
        assert load_config(name).model.name == "tiny", name
    (tmp_path / "mine.yaml").write_text("grpo:\n  steps: 7\n")
    assert load_config("mine.yaml").grpo.steps == 7  # the current directory first
    with pytest.raises(ConfigError, match=r"config file not found: configs/nosuch.yaml \(looked at"):
        load_config("configs/nosuch.yaml")


@pytest.mark.parametrize("override, message", [
    ("grpo.lr=nan", "grpo.lr must be a finite number"),
    ("grpo.lr=-1", "grpo.lr must be > 0"),
    ("grpo.kl_coef=-0.1", "grpo.kl_coef must be ≥ 0"),
    ("grpo.max_grad_norm=0", "grpo.max_grad_norm must be > 0"),
    ("detectors.kl_spike.z=inf", "detectors.kl_spike.z must be a finite number"),
    ("eval.n_dev=0", "eval.n_dev must be ≥ 1"),
    ("eval.batch_size=0", "eval.batch_size must be ≥ 1"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens must be ≥ 1"),
    ("rollout.group_size=1", "a group of one has advantage 0 and trains nothing"),
])
def test_numeric_settings_are_checked_before_anything_runs(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_group_size_one_is_fine_without_grpo_or_with_added_gold_members():
    assert load_config("smoke", ["rollout.group_size=1", "grpo.steps=0"]).rollout.group_size == 1
    assert load_config("smoke", ["rollout.group_size=1", "signals.ops.enabled=true", "signals.ops.mode=add"]).rollout.group_size == 1
    assert load_config("smoke", ["rollout.group_size=1", "grpo.baseline=batch"]).rollout.group_size == 1  # REINFORCE with a batch baseline


@pytest.mark.parametrize("overrides, message", [
    (["signals.hint.enabled=true", "signals.hint.kinds=[first_call,bogus]"], "signals.hint.kinds: unknown hint kind(s) ['bogus']"),
    (["signals.hint.enabled=true", "signals.hint.position=middle"], "signals.hint.position must be system or user, got 'middle'"),
    (["signals.ets.window=0"], "signals.ets.window must be ≥ 1"),
    (["signals.ets.capacity=0"], "signals.ets.capacity must be ≥ 1"),
    (["detectors.kl_spike.action=explode"], "detectors.kl_spike.action must be warn, stop or rollback, got 'explode'"),
    (["report_to=[tensorbored]"], "report_to: unknown tracker 'tensorbored'"),
    (["model.device=gpu"], "model.device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
])
def test_settings_once_refused_mid_run_are_checked_at_load(overrides, message):
    """These were ValueErrors (tracebacks) from the objects they configure, raised after the run
    directory was made, or (detectors' action) never: now one-line ConfigErrors at load time."""
    with pytest.raises(ConfigError) as e:
        load_config("smoke", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_keeping_freed_memory_and_returning_it_are_refused_together():
    assert load_config(None, ["run.keep_freed_memory=true"]).run.keep_freed_memory is True
    with pytest.raises(ConfigError, match="run.keep_freed_memory and run.malloc_mmap_threshold_mb contradict each other"):
        load_config(None, ["run.keep_freed_memory=true", "run.malloc_mmap_threshold_mb=1"])
