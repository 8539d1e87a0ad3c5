"""The `keel` command: train, sweep, eval, data, diagnose, report, compare.

Every user error (bad config key, missing file, existing run directory) ends with one line
`keel: error: ...` and exit status 2; nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from keel.errors import UserError

EPILOG_TRAIN = """examples:
  keel train configs/main.yaml                       # SmolLM2-135M, synthetic KG: SFT warm-start, then GRPO
  keel train configs/main.yaml --smoke               # same config on the tiny model, a few seconds
  keel train configs/main.yaml --set grpo.steps=20 --set grpo.kl_coef=0.001 --out runs/kl-1e-3
  keel train --help-config                           # every config key, its default and meaning
"""

EPILOG_SWEEP = """examples:
  keel sweep configs/kg_grpo.yaml configs/kg_sft_grpo.yaml --seeds 0,1,2 --out runs/paperA-kg
  keel sweep configs/smoke.yaml --seeds 0,1 --smoke --set grpo.steps=3 --out runs/sweep-smoke
  (Ctrl-C stops the sweep after checkpointing the current run; the same command continues it)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel", description="Keel: GRPO for multi-step tool use, with the supervision that prevents collapse and the diagnostics that catch it.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="train a policy (SFT warm-start + GRPO) from a config preset", epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run a training job into a new run directory (config.yaml, metrics.jsonl, samples/, eval/, checkpoints/, summary.json).")
    t.add_argument("config", nargs="?", help="YAML preset (a path, or a name under configs/ such as 'main' or 'smoke')")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one config key (type-checked), e.g. --set grpo.lr=1e-6; repeatable")
    t.add_argument("--out", help="run directory to create (must not exist or be empty); default: <run.out>/<preset>-<n>")
    t.add_argument("--smoke", action="store_true", help="shrink the preset to the tiny model and a minimal budget, to check it runs in seconds")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from checkpoints/latest (its config.yaml; --set may extend it, e.g. grpo.steps)")
    t.add_argument("--help-config", action="store_true", help="print every config key with its default and documentation")

    sw = sub.add_parser("sweep", help="train presets × seeds one after another into DIR, continue it when re-run, then compare",
                        epilog=EPILOG_SWEEP, formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Train every preset with every seed, one run after another, into DIR/<preset>-s<seed> (run.seed = seed), then "
                                    "write `keel compare` of all runs to DIR/compare.txt and DIR/compare.html. Re-running the same command "
                                    "skips finished runs and continues an interrupted one; other arguments for the same DIR are refused.")
    sw.add_argument("presets", nargs="+", metavar="PRESET", help="YAML presets (paths, or names under configs/)")
    sw.add_argument("--seeds", default="0", help="comma-separated run.seed values, e.g. 0,1,2 (default: 0)")
    sw.add_argument("--out", required=True, metavar="DIR", help="sweep directory (new, empty, or this same sweep to continue it)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one config key in every run; repeatable")
    sw.add_argument("--smoke", action="store_true", help="shrink every run as `keel train --smoke` does")

    e = sub.add_parser("eval", help="evaluate a policy (model dir, 'smollm2', 'oracle', 'null') on KG, BFCL or ACEBench tasks",
                       description="Evaluate a policy and write DIR/summary.json (eval/em, eval/f1, eval/tools_per_question, n, ...) and DIR/results.jsonl (one line per question).")
    e.add_argument("--env", default="kg", choices=["kg", "bfcl", "acebench"], help="task family")
    e.add_argument("--data", help="questions file (kg: Keel JSONL, CWQ, PathQuestion, MetaQA) or data directory (acebench; kg: a `keel data kg-synth` dir)")
    e.add_argument("--kb", help="kg: triples file (TSV or |-separated); not needed when --data is a dataset directory")
    e.add_argument("--format", default="auto", help="kg question format: auto | keel | cwq | pathquestion | metaqa")
    e.add_argument("--split", default="dev", help="kg dataset directory: which split to evaluate (train | dev | test)")
    e.add_argument("--policy", required=True, help="oracle | null | smollm2 | tiny | a local model directory | endpoint (an OpenAI-compatible chat server)")
    e.add_argument("--base-url", default="", help="policy endpoint: server base URL, e.g. http://localhost:8000/v1")
    e.add_argument("--endpoint-model", default="", help="policy endpoint: model name sent to the server")
    e.add_argument("--api-key", default="", help="policy endpoint: API key (default: $OPENAI_API_KEY)")
    e.add_argument("--call-formats", default="json", help="bfcl/acebench: call formats, the first in-distribution, the rest format-OOD (json, python, python_tagged)")
    e.add_argument("--heldout-classes", default="", help="bfcl: API classes held out as content-OOD, e.g. TravelAPI,TicketAPI")
    e.add_argument("--categories", default="", help="bfcl/acebench: comma-separated categories (default: all multi-turn / all)")
    e.add_argument("--limit", type=int, default=0, help="evaluate only the first N questions (0: all)")
    e.add_argument("--max-turns", type=int, default=5, help="assistant turns per episode")
    e.add_argument("--max-new-tokens", type=int, default=128, help="model policies: tokens per turn")
    e.add_argument("--batch-size", type=int, default=16, help="model policies: episodes per batched rollout")
    e.add_argument("--out", required=True, help="output directory (must not exist or be empty)")

    d = sub.add_parser("data", help="generate or check datasets", description="Dataset tools.")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION")
    g = dsub.add_parser("kg-synth", help="write a seeded Freebase-like KG with CWQ-like questions (kb.tsv, train/dev/test.jsonl, meta.json)")
    g.add_argument("--out", required=True, help="directory to create")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--train", type=int, default=1000)
    g.add_argument("--dev", type=int, default=100)
    g.add_argument("--test", type=int, default=200)
    c = dsub.add_parser("check", help="load a KG and questions, print counts and the oracle's EM on them")
    c.add_argument("--data", required=True, help="questions file or dataset directory")
    c.add_argument("--kb", help="triples file (not needed for a dataset directory)")
    c.add_argument("--format", default="auto")
    c.add_argument("--limit", type=int, default=0)

    ds = sub.add_parser("distill", help="ReST-EM (paper B rung 7): greedy rollouts of a checkpoint over the training questions, keep EM=1 with a successful call and valid format",
                        description="Write the kept episodes as JSONL; train on them with signals.self_distill.trajectories (configs/kg_self_distill.yaml).")
    ds.add_argument("config", help="the preset whose data/env the checkpoint was trained on")
    ds.add_argument("--checkpoint", required=True, help="model directory, e.g. RUN/checkpoints/peak")
    ds.add_argument("--out", required=True, help="JSONL file to write (must not exist)")
    ds.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ds.add_argument("--limit", type=int, default=0, help="only the first N training questions (0: all)")

    dg = sub.add_parser("diagnose", help="name a run's failure mode (or healthy) with evidence; writes RUN_DIR/diagnosis.json")
    dg.add_argument("run_dir")
    r = sub.add_parser("report", help="write RUN_DIR/report.html (self-contained plots and trajectory viewer)")
    r.add_argument("run_dir")
    cp = sub.add_parser("compare", help="compare runs: eval metrics with Wilson 95%% intervals and McNemar tests")
    cp.add_argument("run_dirs", nargs="+")
    cp.add_argument("--out", help="write the comparison page here (HTML)")
    cp.add_argument("--at", default="final", help="which eval of each run: final, peak (by EM) or a step number")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.command:
        _parser().print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError, KeyError, RuntimeError, OSError) as e:
        from keel.config import ConfigError
        from keel.rundir import RunDirError
        from keel.tasks import DataError

        known = (ConfigError, RunDirError, DataError, FileNotFoundError, FileExistsError, PermissionError)
        if isinstance(e, known) or type(e) is ValueError:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"keel: error: {msg}", file=sys.stderr)
            return 2
        raise


def _train(args) -> int:
    from keel.config import describe, load_config
    from keel.rundir import create_run_dir, default_run_dir

    if args.help_config:
        print(describe())
        return 0
    if args.resume:
        run = Path(args.resume)
        if not (run / "config.yaml").exists():
            raise FileNotFoundError(f"--resume {run}: no config.yaml (not a Keel run directory)")
        if args.config or args.smoke or args.out:
            raise UserError("--resume takes the run's own config.yaml; do not also give a preset, --smoke or --out")
        summary = resume_run(run, args.overrides)
        if os.environ.get("RANK", "0") != "0":
            return 0
        print(json.dumps({k: summary[k] for k in ("eval_before_sft", "eval_after_sft", "eval_final", "wall_time_s") if k in summary}, indent=2))
        print(f"[keel] run directory: {run}")
        return 0
    if not args.config:
        raise UserError("train: give a config preset, e.g. `keel train configs/main.yaml` (see --help)")
    cfg = load_config(args.config, args.overrides, smoke=args.smoke)
    name = Path(args.config).stem + ("-smoke" if args.smoke else "")
    from keel.distributed import broadcast_object, init_distributed

    ctx = init_distributed()  # one process unless started by torchrun / accelerate launch
    out, problem = None, None
    if ctx.is_main:  # rank 0 chooses and checks the run directory; the others are told the outcome
        out = Path(args.out) if args.out else default_run_dir(cfg.run.out, name)
        try:
            create_run_dir(out)  # refuse an existing run before loading anything
        except Exception as e:
            problem = e
    out, problem = broadcast_object((out, problem), ctx)
    if problem is not None:
        raise problem
    from keel.train import train

    try:
        summary = train(cfg, out, ctx=ctx)
    except BaseException:
        if ctx.is_main:
            _remove_if_fresh(out)
        raise
    if not ctx.is_main:
        return 0
    print(json.dumps({k: summary[k] for k in ("eval_before_sft", "eval_after_sft", "eval_final", "wall_time_s") if k in summary}, indent=2))
    print(f"[keel] run directory: {out}")
    return 0


def resume_run(run: Path, overrides: list[str] | None = None) -> dict:
    """`keel train --resume RUN`: its own config.yaml (plus `overrides`), from checkpoints/latest.
    `keel sweep` continues its interrupted runs through this same function."""
    from keel.config import load_config
    from keel.train import train

    run = Path(run)
    if not (run / "config.yaml").exists():
        raise FileNotFoundError(f"--resume {run}: no config.yaml (not a Keel run directory)")
    cfg = load_config(run / "config.yaml", overrides or [])
    return train(cfg, run, resume=True)


def _remove_if_fresh(out: Path) -> None:
    """A run that failed before writing any metrics leaves no directory behind."""
    if out.exists() and not (out / "metrics.jsonl").exists():
        shutil.rmtree(out, ignore_errors=True)


def _kg_tasks(args):
    from keel.kg.loaders import load_store, load_tasks
    from keel.tasks import DataError

    if not args.data:
        raise DataError("eval: --data is required")
    data = Path(args.data)
    if not data.exists():
        raise DataError(f"eval: --data not found: {data}")
    if data.is_dir():
        kb = data / "kb.tsv"
        split = data / f"{getattr(args, 'split', 'dev')}.jsonl"
        if not kb.exists() or not split.exists():
            raise DataError(f"eval: dataset directory {data} needs kb.tsv and {split.name}")
        store, tasks = load_store(kb), load_tasks(split, "keel")
    else:
        if not args.kb:
            raise DataError("eval: --kb TRIPLES is required when --data is a questions file")
        if not Path(args.kb).exists():
            raise DataError(f"eval: --kb not found: {args.kb}")
        store = load_store(Path(args.kb))
        tasks = load_tasks(data, args.format, store=store)
    if args.limit:
        tasks = tasks[: args.limit]
    return store, tasks


def _eval(args) -> int:
    from keel.rundir import atomic_write_json, create_run_dir, write_jsonl

    out = Path(args.out)
    if args.env != "kg":
        create_run_dir(out)
        try:
            summary = _fc_eval(args)
        except BaseException:
            _remove_if_fresh_eval(out)
            raise
        print(json.dumps(summary, indent=2))
        return 0
    from keel.evaluate import evaluate_model, evaluate_text_policy
    from keel.kg.env import KGEnv
    from keel.kg.oracle import null_policy, oracle_policy

    store, tasks = _kg_tasks(args)
    create_run_dir(out)
    env = KGEnv(store)
    if args.policy in ("oracle", "null", "endpoint"):
        policy = {"oracle": oracle_policy, "null": null_policy}.get(args.policy) or _endpoint(args, lambda task: env.tools(task))
        means, rows, trajs = evaluate_text_policy(env, tasks, policy, args.max_turns)
    else:
        from keel.models import load_model
        from keel.rollout import SamplingParams

        model, tok = load_model(args.policy)
        params = SamplingParams(greedy=True, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_total_tokens=4096)
        means, rows, trajs = evaluate_model(model, tok, env, tasks, params, args.batch_size)
    from keel.diagnostics.errors import decompose_errors

    errors = decompose_errors(trajs, tasks, store)  # paper B's error decomposition, by replaying gold paths
    summary = {**means, "n": len(rows), "policy": args.policy, "data": str(args.data),
               "errors": {k: errors[k] for k in ("failed", "counts", "shares", "retrieval_dependent", "retrieval_shares")}}
    write_jsonl(out / "results.jsonl", rows)
    atomic_write_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=2))
    return 0


def _endpoint(args, tools_for):
    """paper B's GPT-4o control: any OpenAI-compatible chat model through the same tool loop."""
    import os

    from keel.endpoint import chat, hermes_messages

    if not args.base_url or not args.endpoint_model:
        raise UserError("eval --policy endpoint needs --base-url and --endpoint-model")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or None

    def policy(task, messages):
        return chat(args.base_url, args.endpoint_model, hermes_messages(messages, tools_for(task)), api_key=key,
                    max_tokens=args.max_new_tokens)

    return policy


def _fc_eval(args) -> dict:
    """BFCL / ACEBench through keel.fc.evaluate (bfcl-eval's own checkers), ID and OOD side by side."""
    from keel.fc.evaluate import _env_for, evaluate_fc

    formats = tuple(f for f in args.call_formats.split(",") if f)
    categories = [c for c in args.categories.split(",") if c] or None
    heldout = tuple(c for c in args.heldout_classes.split(",") if c)
    policy = args.policy
    if policy not in ("oracle", "null"):
        if policy == "endpoint":
            def factory(fmt):
                return _endpoint(args, lambda task: _env_for(args.env, task, fmt).tools(task))
        else:
            from keel.evaluate import model_text_policy
            from keel.models import load_model

            model, tok = load_model(policy)

            def factory(fmt):
                return model_text_policy(model, tok, lambda task: _env_for(args.env, task, fmt).tools(task), args.max_new_tokens)
        factory.is_policy_factory = True
        policy = factory
    if args.env == "acebench" and not args.data:
        raise UserError("eval --env acebench needs --data DIR (ACEBench's data_en directory)")
    return evaluate_fc(args.env, policy, data=args.data, categories=categories, out_dir=args.out, call_formats=formats,
                       heldout_classes=heldout, limit=args.limit or None)


def _remove_if_fresh_eval(out: Path) -> None:
    if out.exists() and not (out / "summary.json").exists():
        shutil.rmtree(out, ignore_errors=True)


def _data(args) -> int:
    if args.data_command == "kg-synth":
        from keel.kg.synth import generate

        meta = generate(args.out, seed=args.seed, train=args.train, dev=args.dev, test=args.test)
        print(json.dumps(meta, indent=2))
        return 0
    if args.data_command == "check":
        from keel.evaluate import evaluate_text_policy
        from keel.kg.env import KGEnv
        from keel.kg.oracle import oracle_policy

        store, tasks = _kg_tasks(args)
        means, _, _ = evaluate_text_policy(KGEnv(store), tasks, oracle_policy, 8)
        print(json.dumps({"triples": getattr(store, "num_triples", None), "questions": len(tasks), "oracle": means}, indent=2))
        return 0
    raise UserError("data: choose an action: kg-synth | check (see `keel data --help`)")


def _distill(args) -> int:
    from keel import tasks as task_builder
    from keel.config import load_config
    from keel.models import load_model
    from keel.rollout import SamplingParams
    from keel.signals.restem import distill, write_trajectories

    out = Path(args.out)
    if out.exists():
        raise FileExistsError(f"distill: {out} already exists; choose another --out")
    if not Path(args.checkpoint).is_dir():
        raise FileNotFoundError(f"distill: checkpoint directory not found: {args.checkpoint}")
    cfg = load_config(args.config, args.overrides)
    env, train_tasks, _ = task_builder.build(cfg, None)
    if args.limit:
        train_tasks = train_tasks[: args.limit]
    model, tok = load_model(args.checkpoint)
    params = SamplingParams(greedy=True, max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
    kept, counts = distill(model, tok, env, train_tasks, params, cfg.eval.batch_size)
    write_trajectories(out, kept)
    print(json.dumps({"questions": len(train_tasks), "kept": len(kept), "rejected": counts}, indent=2))
    return 0


def _diagnose(args) -> int:
    from keel.diagnostics.classify import diagnose, format_diagnosis

    run = Path(args.run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"diagnose: run directory not found: {run}")
    print(format_diagnosis(diagnose(run)))
    return 0


def _report(args) -> int:
    from keel.report import write_report

    run = Path(args.run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"report: run directory not found: {run}")
    print(write_report(run))
    return 0


def _compare(args) -> int:
    from keel.compare import compare_runs

    for r in args.run_dirs:
        if not Path(r).is_dir():
            raise FileNotFoundError(f"compare: run directory not found: {r}")
    at = int(args.at) if args.at.isdigit() else args.at
    result = compare_runs([Path(r) for r in args.run_dirs], out=Path(args.out) if args.out else None, at=at)
    print(result["table"])
    if result.get("html"):
        print(f"wrote {result['html']}")
    return 0


def _sweep(args) -> int:
    from keel.sweep import run_sweep

    return run_sweep(args.presets, args.seeds, args.out, args.overrides, smoke=args.smoke)


COMMANDS = {"sweep": _sweep, "distill": _distill, "train": _train, "eval": _eval, "data": _data, "diagnose": _diagnose, "report": _report, "compare": _compare}


if __name__ == "__main__":
    sys.exit(main())
