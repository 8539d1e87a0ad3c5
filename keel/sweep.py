"""`keel sweep`: presets × seeds, one run after another, in one directory a re-run continues.

    DIR/sweep.json          the arguments (presets, seeds, overrides, smoke), written first
    DIR/<stem>-s<seed>/     one ordinary run directory per preset and seed (run.seed = seed)
    DIR/compare.txt, .html  `keel compare` over all runs, once every run is done (with several
                            presets and seeds, each preset's seeds pooled into an arm: --pool)

Re-running the same command is how a sweep continues: a run whose summary.json says it is done
is skipped, a run directory with a config.yaml is continued exactly as `keel train --resume`
continues it, and the rest start fresh. Everything that could refuse is checked before
anything is written, so a typo in `--set` cannot add runs of another experiment to DIR.

Runs go one after another, never side by side: parallel runs on the same cores (or GPU) would
slow each other and make their time/ and mem/ numbers meaningless. They run in this process
through `keel.train.train`, the function `keel train` calls, not in subprocesses: every run
seeds Python's and torch's generators itself when it starts, and tests/test_sweep.py checks
that a run trained after another in the same process has the same metrics as one resumed in a
fresh process after a kill. Of the process-wide settings a run makes, torch's CPU thread count
(`run.threads`) could change the next run's numerics, so it is restored after each run; glibc's
memory settings (`run.malloc_mmap_threshold_mb`, `run.keep_freed_memory`) stay, which changes memory use,
not results.
Under torchrun (WORLD_SIZE > 1) a sweep is refused: start `keel train` per run there.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.errors import UserError
from keel.resume import exit_status, resume_run
from keel.rundir import RunDirError, atomic_write_json, atomic_write_text, claim_run_dir, is_empty_dir, lock_run_dir

SWEEP_FILE = "sweep.json"
ARGUMENT_KEYS = ("presets", "seeds", "overrides", "smoke")  # what must match for a re-run to continue DIR
OWN_FILES = {SWEEP_FILE, "compare.txt", "compare.html"}
INTERRUPTED = 130  # exit status of a sweep stopped by Ctrl-C (as the CLI's KeyboardInterrupt)


@dataclass
class PlannedRun:
    name: str  # <preset stem>-s<seed>, the run directory's name under DIR
    preset: str
    seed: int
    cfg: Any  # keel.config.Config
    state: str = "fresh"  # fresh | resume | done


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' → [0, 1, 2]; a repeated seed would name one run directory twice."""
    seeds = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            seeds.append(int(part))
        except ValueError:
            raise UserError(f"sweep: --seeds takes comma-separated integers, e.g. 0,1,2; got {text!r}") from None
    if not seeds:
        raise UserError("sweep: --seeds is empty; give e.g. --seeds 0,1,2")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"sweep: --seeds repeats a seed: {text!r}")
    return seeds


def sweep_command(presets: list[str], seeds: list[int], out: Path, overrides: list[str], smoke: bool) -> str:
    """The command that continues this sweep (printed when it stops)."""
    words = ["keel", "sweep", *presets, "--seeds", ",".join(map(str, seeds)), "--out", str(out)]
    for o in overrides:
        words += ["--set", o]
    if smoke:
        words.append("--smoke")
    return " ".join(shlex.quote(w) for w in words)


def config_difference(there, here) -> list[str]:
    """The keys whose values differ between a run's config and this sweep's, as one phrase each."""
    from keel.config import leaves

    a, b = leaves(there), leaves(here)
    return [f"{k} is {a.get(k)!r} there, {b.get(k)!r} in this sweep" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def plan(presets: list[str], seeds: list[int], overrides: list[str], smoke: bool) -> list[PlannedRun]:
    """Every run's resolved config, preset-major (all seeds of the first preset first); loading
    them all up front makes a bad key or missing preset fail before any run starts."""
    from keel.config import load_config, parse_override

    for o in overrides:
        if parse_override(o)[0] == "run.seed":
            raise UserError("sweep: run.seed is set per run from --seeds; do not also --set it")
    stems = [Path(p).stem for p in presets]
    for s in stems:
        if stems.count(s) > 1:
            raise UserError(f"sweep: two presets named {s!r} would share run directories; give each preset once")
    return [PlannedRun(f"{stem}-s{seed}", preset, seed, load_config(preset, [*overrides, f"run.seed={seed}"], smoke=smoke))
            for preset, stem in zip(presets, stems) for seed in seeds]


def _summary_done(run: Path) -> bool:
    try:
        s = json.loads((run / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(s, dict) and s.get("phase") == "done" and s.get("interrupted") is False


def check(out: Path, args: dict[str, Any], runs: list[PlannedRun]) -> None:
    """Refuse (RunDirError, nothing written) unless DIR is new, empty, or holds this same sweep;
    set each run's state (fresh, resume, done) from its directory."""
    from keel.config import load_config

    again = f"use another --out, or the arguments of {out / SWEEP_FILE}"
    if out.exists() and not out.is_dir():
        raise RunDirError(f"sweep: --out {out} exists and is not a directory")
    if out.is_dir() and not is_empty_dir(out):
        try:
            before = json.loads((out / SWEEP_FILE).read_text())
        except FileNotFoundError:
            raise RunDirError(f"sweep: {out} is not empty and has no {SWEEP_FILE} (not a sweep directory); choose another --out") from None
        except (OSError, json.JSONDecodeError) as e:
            raise RunDirError(f"sweep: {out / SWEEP_FILE} is unreadable ({e}); choose another --out") from None
        changed = [k for k in ARGUMENT_KEYS if before.get(k) != args[k]]
        if changed:
            k = changed[0]
            raise RunDirError(f"sweep: {out} holds a sweep with other {k} ({before.get(k)!r}, now {args[k]!r}); {again}")
        planned = {r.name for r in runs}
        for d in sorted(p for p in out.iterdir() if p.is_dir() and p.name not in planned):
            if (d / "config.yaml").exists():
                raise RunDirError(f"sweep: {d} is a run that is not part of this sweep; {again}")
    for r in runs:
        d = out / r.name
        if not d.is_dir() or is_empty_dir(d):
            r.state = "fresh"
            continue
        if not (d / "config.yaml").exists():
            raise RunDirError(f"sweep: {d} exists but is not a run directory (no config.yaml); remove it or choose another --out")
        diff = config_difference(load_config(d / "config.yaml"), r.cfg)
        if diff:
            raise RunDirError(f"sweep: {d}/config.yaml differs from this sweep's config ({diff[0]}{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}); {again}")
        r.state = "done" if _summary_done(d) else "resume"


def _train_one(r: PlannedRun, run: Path) -> dict[str, Any]:
    """One run, fresh or continued, through the functions `keel train` uses."""
    import torch

    from keel.train import train

    threads = torch.get_num_threads()
    try:
        if r.state == "resume":  # `keel train --resume RUN` (config.yaml checked equal above)
            return resume_run(run, announce=False) or json.loads((run / "summary.json").read_text())
        return train(r.cfg, run)  # owns `run` while it trains; a run that logged nothing leaves nothing
    finally:
        torch.set_num_threads(threads)  # run.threads must not carry over to the next run
        gc.collect()  # free this run's model before the next one loads its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_sweep(presets: list[str], seeds_text: str, out: str | Path, overrides: list[str] | None = None, smoke: bool = False) -> int:
    """Run (or continue) the sweep; 0 when every run is done and compared, 130 (143) when a run
    was interrupted by SIGINT (SIGTERM): the sweep stops there and says how to continue."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("sweep: runs in one process; under torchrun / accelerate launch, start `keel train` for each run")
    out = Path(out)
    overrides = list(overrides or [])
    seeds = parse_seeds(seeds_text)
    args = {"presets": list(presets), "seeds": seeds, "overrides": overrides, "smoke": bool(smoke)}
    again = sweep_command(list(presets), seeds, out, overrides, smoke)
    runs = plan(list(presets), seeds, overrides, smoke)
    check(out, args, runs)
    # one process runs a sweep: DIR is locked as a run directory is (new or empty: made, disk checked)
    lock = lock_run_dir(out) if (out / SWEEP_FILE).exists() else claim_run_dir(out)
    try:
        if not (out / SWEEP_FILE).exists():
            atomic_write_json(out / SWEEP_FILE, {**args, "runs": [r.name for r in runs]})
        return _run_all(out, runs, again)
    finally:
        lock.release()


def _run_all(out: Path, runs: list[PlannedRun], again: str) -> int:
    from keel.compare import compare_runs

    for i, r in enumerate(runs, 1):
        run = out / r.name
        what = {"done": "done already, skipped", "resume": "continuing it", "fresh": "starting"}[r.state]
        print(f"[keel] sweep {i}/{len(runs)}: {run} ({r.preset}, seed {r.seed}): {what}", flush=True)
        if r.state == "done":
            continue
        try:
            summary = _train_one(r, run)
        except BaseException:
            print(f"[keel] sweep stopped at {run}; continue with: {again}", flush=True)
            raise
        if summary.get("interrupted"):
            print(f"[keel] sweep stopped at {run} (interrupted); continue with: {again}", flush=True)
            return exit_status(summary)  # 130 after SIGINT, 143 after SIGTERM
        em = (summary.get("eval_final") or {}).get("eval/em")
        lift = summary.get("rl_lift/em")
        print(f"[keel] sweep {i}/{len(runs)}: {run} done" + (f" (dev EM {em:.3f})" if isinstance(em, (int, float)) else "")
              + (f", RL lift {lift:+.2f} (McNemar p={summary['rl_lift/p_value']:.3g})" if isinstance(lift, (int, float)) else ""), flush=True)
    # All runs share a folder, so their names (<stem>-s<seed>) are unique. Several presets over
    # several seeds: each preset's seeds are pooled into one arm and arms are tested against each
    # other (compare_runs(pool=True)); one preset: its seeds are tested against each other.
    pool = len({r.preset for r in runs}) > 1 and len({r.seed for r in runs}) > 1
    try:
        result = compare_runs([out / r.name for r in runs], out=out / "compare.html", pool=pool)
    except UserError as exc:  # two presets that differ only in run.* cannot be told apart as arms
        if not pool:
            raise
        print(f"[keel] sweep: seeds not pooled ({exc}); comparing run against run", flush=True)
        result = compare_runs([out / r.name for r in runs], out=out / "compare.html")
    atomic_write_text(out / "compare.txt", result["table"] + "\n")
    print(result["table"])
    print(f"wrote {out / 'compare.txt'} and {result['html']}")
    return 0
