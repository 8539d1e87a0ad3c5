"""Paper A's claim 3 evaluation (format and content OOD) of fc_learn runs.

Each run's final checkpoint on its preset's dev tasks, with calls written as Hermes JSON (the
trained format) and as Python call lists (format-OOD: `env.call_format=python`, BFCL's own prompt
and parser); summary.json's `em_by_kind` splits the classes the run trained on from those
`data.fc_train_classes` left out (content-OOD). Writes RUN/ood-json and RUN/ood-python through
`keel eval --config`, which refuses an existing output directory.

    python scripts/ood_eval.py RUN_DIR... [--limit 40]
    python scripts/ood_eval.py --base configs/fc_sft_grpo.yaml --out DIR [--set KEY=VALUE]   (the base model)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from keel.cli import main as keel

FORMATS = ("json", "python")


def evaluate(config: str, policy: str, prefix: str, limit: int, overrides: list[str]) -> None:
    for fmt in FORMATS:
        out = f"{prefix}-{fmt}"
        sets = [a for s in [*overrides, f"env.call_format={fmt}"] for a in ("--set", s)]
        if keel(["eval", "--config", config, "--policy", policy, *sets, "--limit", str(limit), "--out", out]) != 0:
            sys.exit(f"ood_eval: {policy} in {fmt} failed (see the error above)")
        s = json.loads((Path(out) / "summary.json").read_text())
        by_kind = ", ".join(f"{k} {v['em']:.3f} (n={v['n']})" for k, v in s["em_by_kind"].items())
        print(f"[ood_eval] {policy} {fmt}: em {s['eval/em']:.3f}; {by_kind}", flush=True)


def run() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", help="fc_learn run directories (their config.yaml and checkpoints/latest)")
    p.add_argument("--limit", type=int, default=40, help="dev tasks (the first N)")
    p.add_argument("--base", help="a preset: evaluate the base model (its model.name) instead of/besides runs")
    p.add_argument("--out", help="with --base: output prefix (DIR-json, DIR-python)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="with --base: config overrides")
    a = p.parse_args()
    if a.base:
        if not a.out:
            p.error("--base needs --out")
        from keel.config import load_config

        evaluate(a.base, load_config(a.base, a.overrides).model.name, a.out, a.limit, a.overrides)
    for r in a.runs:
        evaluate(f"{r}/config.yaml", f"{r}/checkpoints/latest", f"{r}/ood", a.limit, [])


if __name__ == "__main__":
    run()
