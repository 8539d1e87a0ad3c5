"""From config to (env, train tasks, dev tasks): the one place a run's data is assembled."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from keel.config import Config, signal_sections
from keel.errors import UserError
from keel.templates import ChatTemplate
from keel.types import Env, Task


class DataError(UserError):
    """Missing or malformed data; the message names the file."""


def _need(path: str, key: str) -> Path:
    if not path:
        raise DataError(f"{key} is empty; set it with --set {key}=PATH")
    p = Path(path)
    if not p.exists():
        raise DataError(f"{key}: file not found: {p}")
    return p


def _synth_config(d) -> "SynthConfig":
    """The generator's settings from the config's data section."""
    from keel.kg.synth import SynthConfig

    return SynthConfig(max_calls_per_turn=d.max_calls_per_turn, max_hops=d.max_hops, nationality_from_birth=d.nationality_from_birth,
                       templates=tuple(d.templates), **({"kinds": tuple(d.kinds)} if d.kinds else {}))


def build(cfg: Config, run_dir: Path | None = None, training: bool = True) -> tuple[Env, list[Task], list[Task]]:
    """The environment and the train/dev tasks a run uses.

    synthetic: the seeded generator's KG and questions, written to run_dir/data for the record.
    dir: a dataset directory (kb.tsv + train.jsonl + dev.jsonl) from `keel data kg-synth`.
    files: a triples file plus question files in any supported format.
    jsonl (env.kind tools / mcp): the user's tasks and tools (`build_tools`); `training` False
    (evaluation) skips the check that the training signals have the gold they need.
    """
    if cfg.env.kind == "fc_learn":
        return _build_fc_learn(cfg)
    if cfg.env.kind in ("tools", "mcp"):
        return build_tools(cfg, training)
    from keel.kg.env import KGEnv
    from keel.kg.loaders import load_store, load_tasks

    d = cfg.data
    if d.source == "synthetic":
        from keel.kg.synth import generate

        target = (run_dir / "data") if run_dir is not None else None
        if target is None:  # generated in memory's stead: a temp dir, gone once loaded
            import tempfile

            with tempfile.TemporaryDirectory(prefix="keel-synth-") as tmp:
                d2 = dataclasses.replace(cfg, data=dataclasses.replace(d, source="dir", dir=""))
                generate(Path(tmp), seed=d.seed, train=d.n_train, dev=d.n_dev, test=d.n_test, overwrite=True,
                         config=_synth_config(d))
                d2.data.dir = tmp
                return build(d2, None)
        # a resumed run finds its data already there (the generator is deterministic; meta.json
        # is written last, so a directory without it is a torn write and is regenerated)
        if not (target / "meta.json").exists():
            generate(target, seed=d.seed, train=d.n_train, dev=d.n_dev, test=d.n_test, overwrite=True,
                     config=_synth_config(d))
        data_dir = target
    elif d.source == "dir":
        data_dir = _need(d.dir, "data.dir")
    else:
        data_dir = None
    if data_dir is not None:
        for name in ("kb.tsv", "train.jsonl", "dev.jsonl"):
            if not (data_dir / name).exists():
                raise DataError(f"data directory {data_dir} has no {name}")
        store = load_store(data_dir / "kb.tsv")
        if not store.num_triples:
            raise DataError(f"{data_dir / 'kb.tsv'} holds no triples")
        train = load_tasks(data_dir / "train.jsonl", "keel")
        dev = load_tasks(data_dir / "dev.jsonl", "keel")
    else:
        store = load_store(_need(d.kb, "data.kb"))
        if not store.num_triples:
            raise DataError(f"data.kb: {d.kb} holds no triples")
        # the store lets loaders derive gold turns for name-keyed data (MetaQA)
        train = load_tasks(_need(d.train, "data.train"), d.format, store=store)
        if d.dev:
            dev = load_tasks(_need(d.dev, "data.dev"), d.format, store=store)
        else:
            shuffled = train[:]
            random.Random(d.seed).shuffle(shuffled)
            cut = max(1, len(shuffled) // 10)
            dev, train = shuffled[:cut], shuffled[cut:]
    if not train:
        raise DataError("no training questions were loaded")
    if not dev:
        raise DataError("no dev questions were loaded")
    env = KGEnv(store, dataclasses.replace(cfg.env))  # env: is a KGEnvConfig; a copy, as before: a rollback's overrides do not reach a built env
    if cfg.env.rename_schema or cfg.env.readable_ids:  # gold turns must use the names the model sees
        train = [env.translate_gold(t) for t in train]
        dev = [env.translate_gold(t) for t in dev]
    if cfg.env.plan:
        train = [env.with_plan(t) for t in train]
        dev = [env.with_plan(t) for t in dev]
    rl_pool(cfg, train, "training")  # refused here, before a run directory exists; keel.run.start keeps the pools
    sft_pool(cfg, train)
    dev = rl_pool(cfg, dev, "dev")
    return env, train, dev


def rl_pool(cfg: Config, tasks: list[Task], which: str) -> list[Task]:
    """The tasks of data.rl_templates (by meta 'template'): what RL trains on and the dev
    evaluations report. All of them when data.rl_templates is empty; none left is a DataError
    naming the set."""
    return _with_templates(tasks, cfg.data.rl_templates, "data.rl_templates", which)


def sft_pool(cfg: Config, train: list[Task]) -> list[Task]:
    """The training tasks of data.sft_templates: the SFT warm-start's questions (every training
    question when it is empty). Independent of data.rl_templates: the two may overlap, or not."""
    return _with_templates(train, cfg.data.sft_templates, "data.sft_templates", "training")


def _with_templates(tasks: list[Task], templates: list[str], key: str, which: str) -> list[Task]:
    keep = set(templates)
    if not keep:
        return tasks
    kept = [t for t in tasks if (t.meta or {}).get("template") in keep]
    if not kept:
        raise DataError(f"{key} {sorted(keep)}: no {which} question has one of these templates")
    return kept


def _build_fc_learn(cfg: Config) -> tuple[Env, list[Task], list[Task]]:
    """Paper A's setting at CPU scale: seeded templated requests over BFCL's own simulators
    (keel.fc.learnable), scored by BFCL's multi-turn checker (reward fc_binary)."""
    from keel.fc.learnable import KIND_CLASSES, LearnableEnv, generate_tasks

    d = cfg.data
    unknown = sorted(set(d.fc_train_classes) - set(KIND_CLASSES.values()))
    if unknown:
        raise DataError(f"data.fc_train_classes: {unknown} are not fc_learn classes (known: {', '.join(KIND_CLASSES.values())})")
    tasks = generate_tasks(d.n_train + d.n_dev, seed=d.seed)
    train, dev = tasks[: d.n_train], tasks[d.n_train :]
    if d.fc_train_classes:  # the classes left out stay in dev only: its content-OOD part
        train = [t for t in train if set(t.meta["involved_classes"]) <= set(d.fc_train_classes)]
    return LearnableEnv(cfg.env.call_format), train, dev


def tools_env(cfg: Config) -> Env:
    """The env of env.kind tools / mcp (keel.tools): the configured backend behind ToolsEnv."""
    from keel.tools.env import ToolsEnv
    from keel.tools.python import ToolLoadError, build_python_backend
    from keel.tools.schema import ToolSchemaError

    e = cfg.env
    try:
        if e.kind == "mcp":
            from keel.tools.mcp import MCPError, MCPTools

            try:
                backend = MCPTools(list(e.mcp_command), timeout_s=e.call_timeout_s)
            except MCPError as exc:
                raise DataError(str(exc)) from None
        else:
            backend = build_python_backend(list(e.tools), e.tools_file, e.tools_schema, e.dispatcher, e.make_state)
    except (ToolLoadError, ToolSchemaError) as exc:
        raise DataError(str(exc)) from None
    return ToolsEnv(backend, e.instructions, e.call_timeout_s, e.max_output_chars, name=e.kind)


def gold_needed_by(cfg: Config) -> list[str]:
    """The switches of what trains on (or shows) the gold trajectory and is on: the SFT
    warm-start on gold, then each signal whose section says it needs gold (keel.config.SignalSection)."""
    warm_start = cfg.sft.enabled and cfg.sft.steps > 0 and not cfg.signals.self_distill.trajectories
    return ["sft.enabled"] * warm_start + [sec.switch_key() for sec in signal_sections(cfg.signals) if sec.needs_gold()]


def build_tools(cfg: Config, training: bool = True) -> tuple[Env, list[Task], list[Task]]:
    """env.kind tools / mcp with data.source jsonl: the user's tools and tasks.

    A signal that needs gold trajectories (SFT warm-start, OPS, ETS, hints, rule reflections) is
    refused, naming the switch, when a training task has no `gold_calls`; a gold call naming a
    tool the env does not have is refused here too, rather than as a failed gold replay.
    """
    from keel.tools.tasks import TaskFileError, has_gold, load_jsonl_tasks

    d = cfg.data
    try:
        train = load_jsonl_tasks(_need(d.train, "data.train"))
        if d.dev:
            dev = load_jsonl_tasks(_need(d.dev, "data.dev"))
        else:
            shuffled = train[:]
            random.Random(d.seed).shuffle(shuffled)
            cut = max(1, len(shuffled) // 10)
            dev, train = shuffled[:cut], shuffled[cut:]
    except TaskFileError as exc:
        raise DataError(str(exc)) from None
    if not train:
        raise DataError("data.train: no training tasks were loaded")
    if not dev:
        raise DataError("data.dev: no dev tasks were loaded")
    needs = gold_needed_by(cfg) if training else []
    missing = [t for t in train if not has_gold(t)]
    if needs and missing:
        raise DataError(f"{needs[0]} trains on gold trajectories, but training task {missing[0].id!r} (and {len(missing) - 1} more) "
                        f"has no gold_calls; add gold_calls to data.train or set {needs[0]}=false")
    env = tools_env(cfg)
    names = {t["function"]["name"] for t in env.tools(train[0])}
    for t in train + dev:
        for turn in t.gold_turns:
            for c in turn:
                if c["name"] not in names:
                    raise DataError(f"task {t.id!r}: gold call names unknown tool {c['name']!r} (tools: {', '.join(sorted(names))})")
    return env, train, dev


def prepare(cfg: Config, run_dir: Path | None, tokenizer, chat: ChatTemplate | None = None) -> tuple[Env, list[Task], list[Task]]:
    """`build`, then drop the questions whose prompt leaves no room for one assistant turn in
    rollout.max_total_tokens (a 1 MB question would otherwise ask for tens of GB in the first
    forward), with a counted warning; a set left empty is a DataError. `chat`: the run's chat
    template (keel.templates), whose prompt is the one measured."""
    env, train, dev = build(cfg, run_dir)
    budget = cfg.rollout.max_total_tokens - max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    train, n_train = drop_overlong(train, tokenizer, env, budget, chat)
    dev, n_dev = drop_overlong(dev, tokenizer, env, budget, chat)
    if n_train or n_dev:
        print(f"[keel] warning: dropped {n_train} training and {n_dev} dev questions whose prompt is longer than "
              f"{budget} tokens (rollout.max_total_tokens={cfg.rollout.max_total_tokens} minus one turn's new tokens)", flush=True)
    if not train:
        raise DataError(f"no training question fits in rollout.max_total_tokens={cfg.rollout.max_total_tokens} (all {n_train} were too long)")
    if not dev:
        raise DataError(f"no dev question fits in rollout.max_total_tokens={cfg.rollout.max_total_tokens} (all {n_dev} were too long)")
    return env, train, dev


def strata(tasks: list[Task], key: str) -> list[str] | None:
    """Each task's value of the meta key `key` (rollout.stratify_by), as strings; None when `key`
    is empty. A task without the key is a DataError naming it."""
    if not key:
        return None
    missing = [t.id for t in tasks if key not in (t.meta or {})]
    if missing:
        raise DataError(f"rollout.stratify_by: {len(missing)} training task(s) have no meta key {key!r} (first: {missing[0]!r})")
    return [str(t.meta[key]) for t in tasks]


SHORT_QUESTION_BYTES = 256  # questions this short are not tokenised here (any prompt budget Keel uses fits them)


def drop_overlong(tasks: list[Task], tokenizer, env: Env, budget: int, chat: ChatTemplate | None = None) -> tuple[list[Task], int]:
    """(tasks whose encoded prompt has at most `budget` tokens, how many were dropped). Only
    questions longer than SHORT_QUESTION_BYTES are encoded, so a normal set costs nothing.
    `chat`: the prompt is that chat template's (keel.templates), else Keel's Hermes one."""
    from keel.rollout import encode_prompt

    def prompt_length(t: Task) -> int:
        if chat is None:
            return len(encode_prompt(tokenizer, env, t)[0])
        return len(chat.encode(chat.start(env.system_prompt(t), env.tools(t), env.user_message(t)).text))

    kept = [t for t in tasks if len(t.question.encode("utf-8", "replace")) <= SHORT_QUESTION_BYTES or prompt_length(t) <= budget]
    return kept, len(tasks) - len(kept)


def check_gold_replay(cfg: Config, env: Env, train: list[Task], tokenizer, chat: ChatTemplate | None = None) -> None:
    """The SFT warm-start trains on gold trajectories replayed in the environment; if none
    replays, say so before a run directory exists (not after the first evaluation). `chat`:
    replayed through the run's chat template, as the SFT phase builds them."""
    if not (cfg.sft.enabled and cfg.sft.steps > 0) or cfg.signals.self_distill.trajectories:
        return
    from keel.sft import gold_trajectory

    for task in train:
        if gold_trajectory(tokenizer, env, task, chat=chat).info.get("gold_ok", True):
            return
    raise DataError(f"sft: none of the {len(train)} training questions' gold trajectories replays in the environment "
                    "(every one has a failing gold call); check data.kb against the questions, or set sft.enabled=false")
