"""The `keel` command: train, sweep, eval, data, diagnose, report, compare.

Every user error (keel.errors.UserError, or an OSError about the user's files and disk: a bad
config value, an unreadable input, a run directory in use, a full disk, a failing endpoint) ends
with one line `keel: error: ...` and exit status 2, and leaves no directory that was not there
before. A run stopped by SIGINT / SIGTERM exits 130 / 143 after checkpointing
(`keel.resume.exit_status`); one stopped before its own handler is installed removes what it
made, SIGTERM as Ctrl-C (`_sigterm_unwinds`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
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

    e = sub.add_parser("eval", help="evaluate a policy (model dir, 'smollm2', 'oracle', 'null') on a preset's tools and data, or on KG, BFCL or ACEBench tasks",
                       description="Evaluate a policy and write DIR/summary.json (eval/em, eval/f1, eval/tools_per_question, n, ...) and DIR/results.jsonl (one line per question).")
    e.add_argument("--config", help="a training preset: evaluate on its own env and data (any env.kind; --split dev|train), with its rollout.max_turns, eval.max_new_tokens and eval.batch_size")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="with --config: override one config key; repeatable")
    e.add_argument("--env", default=None, choices=["kg", "bfcl", "acebench"], help="task family without --config (default kg)")
    e.add_argument("--data", help="questions file (kg: Keel JSONL, CWQ, PathQuestion, MetaQA) or data directory (acebench; kg: a `keel data kg-synth` dir)")
    e.add_argument("--kb", help="kg: triples file (TSV or |-separated); not needed when --data is a dataset directory")
    e.add_argument("--format", default="auto", help="kg question format: auto | keel | cwq | pathquestion | metaqa")
    e.add_argument("--split", default="dev", help="kg dataset directory: which split to evaluate (train | dev | test)")
    e.add_argument("--policy", required=True, help="oracle | null | smollm2 | tiny | a local model directory | endpoint (an OpenAI-compatible chat server)")
    e.add_argument("--base-url", default="", help="policy endpoint: server base URL, e.g. http://localhost:8000/v1")
    e.add_argument("--endpoint-model", default="", help="policy endpoint: model name sent to the server")
    e.add_argument("--api-key", default="", help="policy endpoint: API key (default: $OPENAI_API_KEY)")
    e.add_argument("--timeout", type=float, default=60.0, help="policy endpoint: seconds one request may take in all (connect, headers, body)")
    e.add_argument("--retries", type=int, default=2, help="policy endpoint: further attempts of a failed request (connection, timeout, 429/5xx), after 1, 2, 4... × --backoff s")
    e.add_argument("--backoff", type=float, default=1.0, help="policy endpoint: seconds before the first retry (doubled after each)")
    e.add_argument("--call-formats", default="json", help="bfcl/acebench: call formats, the first in-distribution, the rest format-OOD (json, python, python_tagged)")
    e.add_argument("--heldout-classes", default="", help="bfcl: API classes held out as content-OOD, e.g. TravelAPI,TicketAPI")
    e.add_argument("--categories", default="", help="bfcl/acebench: comma-separated categories (default: all multi-turn / all)")
    e.add_argument("--limit", type=int, default=0, help="evaluate only the first N questions (0: all)")
    e.add_argument("--max-turns", type=int, default=None, help="kg: assistant turns per episode (default 5; with --config: rollout.max_turns); bfcl/acebench follow the benchmark's own step limit")
    e.add_argument("--max-new-tokens", type=int, default=128, help="model policies: tokens per turn")
    e.add_argument("--batch-size", type=int, default=16, help="model policies: episodes per batched rollout")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "auto"],
                   help="model policies without --config: weights' dtype (default float32; bfloat16 ~2.5x faster on a CPU that multiplies bf16 natively, "
                        "greedy outputs may differ; auto: bfloat16 where the device does, keel.models.native_bf16); with --config: --set model.dtype")
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

    dg = sub.add_parser("diagnose", help="name a run's failure mode (or unnamed_collapse: EM fell by half, no signature fits; or healthy) with evidence; writes RUN_DIR/diagnosis.json")
    dg.add_argument("run_dir")
    r = sub.add_parser("report", help="write RUN_DIR/report.html (self-contained plots and trajectory viewer)")
    r.add_argument("run_dir")
    r.add_argument("--figures", metavar="DIR", help="also write each chart as a standalone DIR/<section>-<title>.svg (for Markdown pages)")
    cp = sub.add_parser("compare", help="compare runs: eval metrics with Wilson 95%% intervals and McNemar tests")
    cp.add_argument("run_dirs", nargs="+")
    cp.add_argument("--out", help="write the comparison page here (HTML)")
    cp.add_argument("--at", default="final", help="which eval of each run: final, peak (by EM) or a step number")
    cp.add_argument("--figures", metavar="DIR", help="also write each chart of the comparison as a standalone DIR/compare-<title>.svg")
    cp.add_argument("--rl-axis", action="store_true", help="curves against RL steps done (supervision phases and SFT steps left "
                    "out), so runs with interleaved phases line up with runs without")
    cp.add_argument("--pool", action="store_true", help="pool seeds: runs whose configs differ only in run.* form an arm; test arms "
                    "against each other on their (seed, question) pairs instead of every run against every run")
    return p


def main(argv: list[str] | None = None) -> int:
    from keel.errors import USAGE, Aborted, user_message

    args = _parser().parse_args(argv)
    if not args.command:
        _parser().print_help()
        return 0
    try:
        with _sigterm_unwinds():
            return COMMANDS[args.command](args)
    except Aborted as e:  # a second SIGINT/SIGTERM: stopped mid-step, the last checkpoint stands
        print("keel: aborted", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated) before a run's own handler
        signum = getattr(e, "signum", signal.SIGINT)
        print("keel: interrupted" + ("" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"), file=sys.stderr)
        return 128 + signum
    except Exception as e:
        msg = user_message(e)  # a UserError, or an OSError about the user's files and disk
        if msg is None:
            raise  # a bug: keep the traceback
        print(f"keel: error: {msg}", file=sys.stderr)
        return USAGE


@contextlib.contextmanager
def _sigterm_unwinds():
    """SIGTERM raises keel.errors.Terminated for the whole command, instead of killing the
    process where it stands: a run directory just claimed (config.yaml written, the tracker
    starting) is removed as after Ctrl-C, not left half-made. A training run replaces this with
    its own handler (keel.run.Interrupted: finish the step, checkpoint) while it trains."""
    from keel.errors import Terminated

    def handler(signum, frame):
        raise Terminated(signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not in the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _print_summary(summary: dict, run: Path) -> None:
    keys = ("eval_before_sft", "eval_after_sft", "eval_final", "wall_time_s", "interrupted_by")
    print(json.dumps({k: summary[k] for k in keys if summary.get(k) is not None}, indent=2))
    print(f"[keel] run directory: {run}")


def _train(args) -> int:
    from keel.config import describe, load_config
    from keel.errors import UserError
    from keel.resume import exit_status, resume_run

    if args.help_config:
        print(describe())
        return 0
    if args.resume:
        if args.config or args.smoke or args.out:
            raise UserError("--resume takes the run's own config.yaml; do not also give a preset, --smoke or --out")
        run = Path(args.resume)
        summary = resume_run(run, args.overrides)
        if os.environ.get("RANK", "0") != "0" or summary is None:
            return 0
        _print_summary(summary, run)
        return exit_status(summary)
    if not args.config:
        raise UserError("train: give a config preset, e.g. `keel train configs/main.yaml` (see --help)")
    cfg = load_config(args.config, args.overrides, smoke=args.smoke)
    name = Path(args.config).stem + ("-smoke" if args.smoke else "")
    from keel.distributed import broadcast_object, init_distributed

    ctx = init_distributed()  # one process unless started by torchrun / accelerate launch
    out, lock, prepared, staging, problem = None, None, None, None, None
    if ctx.is_main:  # rank 0 checks everything it can, then makes and locks the run directory; the others are told the outcome
        try:
            if args.out:
                check_out(Path(args.out))
            prepared, staging = preflight(cfg, distributed=ctx.enabled)
            lock = _claim(Path(args.out) if args.out else None, cfg.run.out, name)
            out = lock.path
            if staging is not None and (staging / "data").exists():
                shutil.move(str(staging / "data"), str(out / "data"))  # the synthetic data, for the record
        except Exception as e:
            problem = e
        except BaseException:  # Ctrl-C while loading: nothing is left behind either
            if lock is not None:
                lock.discard()
            raise
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    out, problem = broadcast_object((out, problem), ctx)
    if problem is not None:
        if lock is not None:
            lock.discard()
        raise problem
    from keel.train import train

    try:
        summary = train(cfg, out, ctx=ctx, lock=lock, prepared=prepared)
    except BaseException:
        if lock is not None:
            lock.discard_if_fresh()  # a failure before the first logged step leaves nothing behind
        raise
    finally:
        if lock is not None:
            lock.release()
    if not ctx.is_main:
        return 0
    _print_summary(summary, out)
    return exit_status(summary)


def check_out(out: Path) -> None:
    """--out must be a new or empty directory: refused before anything is loaded or made."""
    from keel.rundir import RunDirError, is_empty_dir

    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a directory; choose another --out")
    if out.is_dir() and not is_empty_dir(out):
        raise RunDirError(f"run directory {out} already exists and is not empty; choose another --out or use --resume {out}")


def _claim(out: Path | None, parent: str, name: str):
    """Lock --out, or the first free <run.out>/<preset>-<n> (another process taking one moves on to the next)."""
    from keel.rundir import RunDirError, claim_run_dir, default_run_dir

    if out is not None:
        return claim_run_dir(out)
    for _ in range(100):
        candidate = default_run_dir(parent, name)
        try:
            return claim_run_dir(candidate)
        except RunDirError as e:
            if not getattr(e, "taken", False):
                raise
    raise RunDirError(f"no free run directory under {parent}/{name}-N; give --out")


def preflight(cfg, distributed: bool = False):
    """What can fail before a run directory exists, run there: the model name, the trajectories
    file (read whole), the model's own chat template (model.chat_format=template), data loading
    (synthetic data into a staging dir), over-long prompts, gold replay.
    Returns (env, train, dev) for `train(prepared=...)` and the staging dir (or None)."""
    import tempfile

    from keel import tasks as task_builder
    from keel.models import check_model_name, load_tokenizer
    from keel.rewards import resolve_reward
    from keel.templates import for_run

    check_model_name(cfg.model.name, "model.name")
    resolve_reward(cfg.reward.name)  # a key of REWARDS or the user's module:function, before any directory exists
    trajectories = cfg.signals.self_distill.trajectories
    if trajectories:
        from keel.signals.restem import read_trajectories, self_distillation_examples

        if not Path(trajectories).is_file():
            raise task_builder.DataError(f"signals.self_distill.trajectories: file not found: {trajectories} (make it with `keel distill`)")
        # read here, not first in the SFT phase, where the pre-SFT eval has already logged into the run directory
        if not self_distillation_examples(read_trajectories(trajectories), packed=cfg.sft.packed):
            raise task_builder.DataError(f"signals.self_distill.trajectories: {trajectories} has no usable episodes")
    if distributed:  # every rank loads the data itself, after rank 0 wrote it (see keel.run.start)
        return None, None
    staging = Path(tempfile.mkdtemp(prefix="keel-staging-")) if cfg.data.source == "synthetic" and cfg.env.kind == "kg" else None
    try:
        tok = load_tokenizer(cfg.model.name, "model.name", own_template=cfg.model.chat_format == "template")
        chat = for_run(cfg, tok)  # model.chat_format=template: a template Keel cannot use is refused here, before any directory
        env, train_tasks, dev = task_builder.prepare(cfg, staging, tok, chat)
        task_builder.check_gold_replay(cfg, env, train_tasks, tok, chat)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return (env, train_tasks, dev), staging


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
        kb_name = kb
    else:
        if not args.kb:
            raise DataError("eval: --kb TRIPLES is required when --data is a questions file")
        if not Path(args.kb).exists():
            raise DataError(f"eval: --kb not found: {args.kb}")
        store = load_store(Path(args.kb))
        kb_name = args.kb
        tasks = load_tasks(data, args.format, store=store)
    if not store.num_triples:
        raise DataError(f"the KB {kb_name} holds no triples")
    if args.limit:
        tasks = tasks[: args.limit]
    return store, tasks


def _eval(args) -> int:
    from keel.rundir import atomic_write_json, write_jsonl

    out = Path(args.out)
    check_out(out)
    if args.config:
        if args.env or args.data or args.kb:
            raise UserError("eval --config takes its env and data from the preset; do not also give --env, --data or --kb")
        if args.dtype:
            raise UserError("eval --config takes the model's dtype from the preset: use --set model.dtype=bfloat16, not --dtype")
        _check_policy(args)
        summary = _holding(out, lambda: _config_eval(args, out))
        print(json.dumps(summary, indent=2))
        return 0
    if args.overrides:
        raise UserError("eval --set needs --config")
    args.env = args.env or "kg"
    args.max_turns = args.max_turns or 5
    if args.env != "kg":
        _check_policy(args)
        summary = _holding(out, lambda: _fc_eval(args))
        print(json.dumps(summary, indent=2))
        return 0
    from keel.kg.env import KGEnv

    store, tasks = _kg_tasks(args)
    _check_policy(args)
    env = KGEnv(store)

    def kg_eval() -> dict:
        summary, rows = _kg_eval(args, env, store, tasks)
        write_jsonl(out / "results.jsonl", rows)
        atomic_write_json(out / "summary.json", summary)
        return summary

    summary = _holding(out, kg_eval)
    print(json.dumps(summary, indent=2))
    return 0


def _holding(out: Path, evaluate):
    """evaluate() with `out` claimed and locked; an evaluation that wrote no summary.json leaves
    no directory behind."""
    from keel.rundir import claim_run_dir

    with claim_run_dir(out) as lock:
        try:
            return evaluate()
        except BaseException:
            if not (out / "summary.json").exists():
                lock.discard()
            raise


def _policy_dtype(args) -> str:
    """--dtype for a model policy: float32 by default, auto resolved for the CPU."""
    if args.dtype == "auto":
        from keel.models import native_bf16

        return "bfloat16" if native_bf16("cpu") else "float32"
    return args.dtype or "float32"


def _check_policy(args) -> None:
    """--policy (an endpoint's arguments, or a model directory) is checked before the output
    directory exists; its errors name --policy, not the training config's model.name."""
    if args.dtype and args.policy in ("oracle", "null", "endpoint"):
        raise UserError(f"eval --dtype applies to a model policy, not --policy {args.policy}")
    if args.policy == "endpoint":
        _endpoint(args, None)
    elif args.policy not in ("oracle", "null"):
        from keel.models import check_model_name

        check_model_name(args.policy, "--policy")


def _warn(message: str) -> None:
    print(f"[keel] warning: {message}", file=sys.stderr, flush=True)


def _kg_eval(args, env, store, tasks) -> tuple[dict, list[dict]]:
    from keel.evaluate import evaluate_model, evaluate_text_policy
    from keel.kg.oracle import null_policy, oracle_policy

    if args.policy in ("oracle", "null", "endpoint"):
        from keel.endpoint import EndpointError

        policy = {"oracle": oracle_policy, "null": null_policy}.get(args.policy) or _endpoint(args, lambda task: env.tools(task))
        means, rows, trajs = evaluate_text_policy(env, tasks, policy, args.max_turns, recover=(EndpointError,), warn=_warn)
    else:
        from keel.models import load_model
        from keel.rollout import SamplingParams

        model, tok = load_model(args.policy, _policy_dtype(args), what="--policy")
        params = SamplingParams(greedy=True, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_total_tokens=4096)
        means, rows, trajs = evaluate_model(model, tok, env, tasks, params, args.batch_size)
    from keel.diagnostics.errors import decompose_errors
    from keel.endpoint import request_errors

    errors = decompose_errors(trajs, tasks, store)  # paper B's error decomposition, by replaying gold paths
    summary = {**means, "n": len(rows), "policy": args.policy, "data": str(args.data),
               "request_errors": request_errors(rows),
               "errors": {k: errors[k] for k in ("failed", "counts", "shares", "retrieval_dependent", "retrieval_shares")}}
    return summary, rows


def _config_eval(args, out: Path) -> dict:
    """`keel eval --config PRESET`: the policy on the preset's own env and tasks (dev or train
    split), scored as the trainer scores its evaluations (keel.evaluate), per-question rows in
    results.jsonl. `oracle` is the env's own: the KG plan walker, BFCL's gold calls, or for
    env.kind tools/mcp the tasks' gold_calls replayed as assistant text, so they go through the
    same parser and dispatcher a model's calls go through."""
    from keel import tasks as task_builder
    from keel.config import load_config
    from keel.evaluate import evaluate_model, evaluate_text_policy, gold_replay_policy
    from keel.rundir import atomic_write_json, write_jsonl
    from keel.types import close_env

    cfg = load_config(args.config, args.overrides)
    if args.split not in ("dev", "train"):
        raise UserError(f"eval --config: --split must be dev or train, got {args.split!r}")
    env, train, dev = task_builder.build(cfg, out, training=False)  # a synthetic KG is written to DIR/data
    try:
        tasks = dev if args.split == "dev" else train
        if args.limit:
            tasks = tasks[: args.limit]
        max_turns = args.max_turns or cfg.rollout.max_turns
        kind = cfg.env.kind
        if args.policy in ("oracle", "null", "endpoint"):
            if args.policy == "endpoint":
                policy = _endpoint(args, env.tools)
            elif kind == "fc_learn":
                from keel.fc.policies import make_oracle, null_policy as fc_null

                policy = make_oracle(cfg.env.call_format) if args.policy == "oracle" else fc_null
            elif kind == "kg":
                from keel.kg.oracle import null_policy, oracle_policy

                policy = oracle_policy if args.policy == "oracle" else null_policy
            else:
                from keel.kg.oracle import null_policy
                from keel.tools.tasks import has_gold

                missing = [t.id for t in tasks if not has_gold(t)]
                if args.policy == "oracle" and missing:
                    raise UserError(f"eval --policy oracle replays gold_calls, but task {missing[0]!r} (and {len(missing) - 1} more) has none")
                policy = gold_replay_policy if args.policy == "oracle" else null_policy
            from keel.endpoint import EndpointError

            # an endpoint's failed request is that question's error once one has been answered, as in the KG and fc evals
            means, rows, trajs = evaluate_text_policy(env, tasks, policy, max_turns, recover=(EndpointError,), warn=_warn)
        else:
            from keel.models import load_model
            from keel.rollout import SamplingParams
            from keel.templates import for_run

            model, tok = load_model(args.policy, cfg.model.dtype, what="--policy", own_template=cfg.model.chat_format == "template")
            params = SamplingParams(greedy=True, max_turns=max_turns, max_new_tokens=cfg.eval.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
            means, rows, trajs = evaluate_model(model, tok, env, tasks, params, cfg.eval.batch_size, chat=for_run(cfg, tok))
        from keel.endpoint import request_errors

        summary = {**means, "n": len(rows), "policy": args.policy, "config": str(args.config), "env": kind, "split": args.split,
                   "request_errors": request_errors(rows), "em_by_kind": em_by_kind(tasks, rows)}
        if kind == "fc_learn":
            summary["call_format"] = cfg.env.call_format
        if kind == "kg":
            from keel.diagnostics.errors import decompose_errors

            errors = decompose_errors(trajs, tasks, env.store)
            summary["errors"] = {k: errors[k] for k in ("failed", "counts", "shares", "retrieval_dependent", "retrieval_shares")}
        write_jsonl(out / "results.jsonl", rows)
        atomic_write_json(out / "summary.json", summary)
        return summary
    finally:
        close_env(env)


def em_by_kind(tasks, rows) -> dict[str, dict[str, float]]:
    """Mean EM and count per task kind (a KG question kind, fc_learn_math / fc_learn_fs, ...):
    with data.fc_train_classes, the kinds left out of training are the content-OOD part of dev."""
    kind_of = {t.id: t.kind for t in tasks}
    ems: dict[str, list[float]] = {}
    for r in rows:
        ems.setdefault(kind_of.get(r["task_id"], ""), []).append(float(r["em"]))
    return {k: {"em": sum(v) / len(v), "n": len(v)} for k, v in sorted(ems.items())}


def _endpoint(args, tools_for):
    """paper B's GPT-4o control: any OpenAI-compatible chat model through the same tool loop."""
    import os

    from keel.endpoint import chat, completions_url, hermes_messages

    if not args.base_url or not args.endpoint_model:
        raise UserError("eval --policy endpoint needs --base-url and --endpoint-model")
    completions_url(args.base_url)  # a bad URL fails before the run directory exists
    if not args.timeout > 0 or args.retries < 0:
        raise UserError(f"eval: --timeout must be > 0 and --retries ≥ 0, got {args.timeout} and {args.retries}")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or None

    def policy(task, messages):
        return chat(args.base_url, args.endpoint_model, hermes_messages(messages, tools_for(task)), api_key=key,
                    max_tokens=args.max_new_tokens, timeout=args.timeout, retries=args.retries, backoff=args.backoff)

    return policy


def _fc_eval(args) -> dict:
    """BFCL / ACEBench through keel.fc.evaluate (bfcl-eval's own checkers), ID and OOD side by side."""
    from keel.fc.evaluate import PolicyFactory, env_for, evaluate_fc

    formats = tuple(f for f in args.call_formats.split(",") if f)
    categories = [c for c in args.categories.split(",") if c] or None
    heldout = tuple(c for c in args.heldout_classes.split(",") if c)
    policy = args.policy
    if policy not in ("oracle", "null"):
        if policy == "endpoint":
            def factory(fmt):
                return _endpoint(args, lambda task: env_for(args.env, task, fmt).tools(task))
            policy = PolicyFactory(factory)
        else:  # a local model: greedy, batched rollouts of --batch-size episodes
            from keel.fc.evaluate import ModelPolicy
            from keel.models import load_model

            model, tok = load_model(policy, _policy_dtype(args), what="--policy")
            policy = ModelPolicy(model, tok, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    if args.env == "acebench" and not args.data:
        raise UserError("eval --env acebench needs --data DIR (ACEBench's data_en directory)")
    from keel.endpoint import EndpointError

    return evaluate_fc(args.env, policy, data=args.data, categories=categories, out_dir=args.out, call_formats=formats,
                       heldout_classes=heldout, limit=args.limit or None, recover=(EndpointError,) if args.policy == "endpoint" else (),
                       progress=lambda line: print(f"[keel] eval {args.env}: {line}", file=sys.stderr, flush=True))


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
        from keel.tasks import DataError

        store, tasks = _kg_tasks(args)
        if not tasks:
            raise DataError(f"data check: {args.data} holds no questions")
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
    if cfg.model.chat_format == "template":  # its episodes are for signals.self_distill, which trains in the Hermes layout only
        raise UserError("distill: model.chat_format=template is not supported (signals.self_distill trains on Hermes-layout episodes); "
                        "use model.chat_format=hermes")
    env, train_tasks, _ = task_builder.build(cfg, None)
    if args.limit:
        train_tasks = train_tasks[: args.limit]
    model, tok = load_model(args.checkpoint, what="--checkpoint")
    params = SamplingParams(greedy=True, max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.rollout.max_total_tokens)
    kept, counts = distill(model, tok, env, train_tasks, params, cfg.eval.batch_size)
    write_trajectories(out, kept)
    print(json.dumps({"questions": len(train_tasks), "kept": len(kept), "rejected": counts}, indent=2))
    return 0


def check_run_logged(run: Path, command: str) -> None:
    """A verdict or a report needs a run that has logged something: refuse (writing nothing)
    a missing directory, one that is not a run, or a run with no metrics line yet."""
    from keel.rundir import RunDirError, read_jsonl

    if not run.is_dir():
        raise RunDirError(f"{command}: run directory not found: {run}")
    if not (run / "config.yaml").exists():
        raise RunDirError(f"{command}: {run} is not a Keel run directory (no config.yaml)")
    if not read_jsonl(run / "metrics.jsonl")[0]:
        raise RunDirError(f"{command}: {run} has no metrics yet (metrics.jsonl is missing or empty): nothing to judge")


def _diagnose(args) -> int:
    from keel.diagnostics.classify import diagnose, format_diagnosis

    run = Path(args.run_dir)
    check_run_logged(run, "diagnose")
    print(format_diagnosis(diagnose(run)))
    return 0


def _report(args) -> int:
    from keel.report import write_report

    run = Path(args.run_dir)
    check_run_logged(run, "report")
    print(write_report(run))
    if args.figures:
        from keel.report import write_figures

        for path in write_figures(run, args.figures):
            print(path)
    return 0


def _compare(args) -> int:
    from keel.compare import compare_runs

    for r in args.run_dirs:
        if not Path(r).is_dir():
            raise FileNotFoundError(f"compare: run directory not found: {r}")
    at = int(args.at) if args.at.isdigit() else args.at
    result = compare_runs([Path(r) for r in args.run_dirs], out=Path(args.out) if args.out else None, at=at, pool=args.pool, rl_axis=args.rl_axis)
    print(result["table"])
    if result.get("html"):
        print(f"wrote {result['html']}")
    if args.figures:
        from keel.compare import write_comparison_figures

        for path in write_comparison_figures(result, [Path(r) for r in args.run_dirs], args.figures, args.rl_axis):
            print(f"wrote {path}")
    return 0


def _sweep(args) -> int:
    from keel.sweep import run_sweep

    return run_sweep(args.presets, args.seeds, args.out, args.overrides, smoke=args.smoke)


COMMANDS = {"sweep": _sweep, "distill": _distill, "train": _train, "eval": _eval, "data": _data, "diagnose": _diagnose, "report": _report, "compare": _compare}


if __name__ == "__main__":
    sys.exit(main())
