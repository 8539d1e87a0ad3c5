"""Run Keel's detectors over a finished run's metrics.jsonl, as the loop feeds them: the eval RL
started from (the last eval line before the first RL line), then every RL line in order.

For runs made before the loop fed the detectors that starting eval (eleventh session), and to see
what other detector settings would have said of a run already made:

    python scripts/replay_detectors.py RUN_DIR [--set detectors.kl_spike.min_history=3 ...]

Prints one line per alert (step, kind, evidence) and, for each step at which dev EM or the
training reward first fell, so a reader can tell whether an alert came before the score showed
the collapse. The detectors are deterministic functions of the lines: a replay with the run's
own config.yaml gives the alerts the fixed loop would have written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel import metrics as M
from keel.config import load_config
from keel.diagnostics.detectors import Detectors
from keel.rundir import read_jsonl


def replay(run_dir: Path, overrides: list[str]) -> list[dict]:
    cfg = load_config(run_dir / "config.yaml", overrides)
    lines, _ = read_jsonl(run_dir / "metrics.jsonl")
    first_rl = next((i for i, line in enumerate(lines) if line.get(M.PHASE) == "rl"), len(lines))
    start = max((i for i, line in enumerate(lines[:first_rl]) if line.get(M.PHASE) == "eval"), default=first_rl)
    detectors = Detectors(cfg.detectors)
    alerts = []
    for line in lines[start:]:
        if line.get(M.PHASE) in ("eval", "rl"):
            alerts += [a.to_dict() for a in detectors.update(int(line["step"]), line)]
    return alerts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    for a in replay(args.run_dir, args.overrides):
        print(f"step {a['step']}: {a['kind']} {json.dumps(a['evidence'], default=str)}")
    lines, _ = read_jsonl(args.run_dir / "metrics.jsonl")
    ems = [(line["step"], line[M.EVAL_EM]) for line in lines if M.EVAL_EM in line]
    rewards = [(line["step"], line[M.REWARD_MEAN]) for line in lines if M.REWARD_MEAN in line]
    print("dev EM:", ", ".join(f"{s}: {v:.2f}" for s, v in ems))
    print("reward/mean:", ", ".join(f"{s}: {v:.2f}" for s, v in rewards))


if __name__ == "__main__":
    main()
