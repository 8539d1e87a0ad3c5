"""How sure a checkpoint is of one relation choice: log P(right) − log P(rival) at the relation
that follows `film.film.directed_by`, for every director question among a preset's dev questions.

The conversation is the gold one up to `"relation": "people.person.`; the two completions are
`place_of_birth"}}` and `nationality"}}`. Positive: the right relation is preferred; the size is
the margin in nats. Used in LOG.md (2026-12-01, seventh session) to show GRPO moving the shared
preference far past the margins SFT built.

    python scripts/decision_margins.py RUN/checkpoints/reference RUN/checkpoints/latest --set run.seed=1
"""

from __future__ import annotations

import argparse

import torch

from keel import tasks as task_builder
from keel.config import load_config
from keel.models import load_model
from keel.sft import gold_trajectory

PREFIX = "people.person."
RIVALS = {"director_birthplace": ("place_of_birth", "nationality"), "director_nationality": ("nationality", "place_of_birth")}


def completion_logprob(model, prefix_ids: list[int], completion_ids: list[int]) -> float:
    ids = torch.tensor([prefix_ids + completion_ids])
    with torch.no_grad():
        logp = model(ids).logits.float().log_softmax(-1)[0]
    n = len(prefix_ids)
    return sum(float(logp[n - 1 + k, c]) for k, c in enumerate(completion_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--config", default="configs/main.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value, as keel train's --set")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    env, _, dev = task_builder.build(cfg, None, training=False)
    tasks = [t for t in dev[: cfg.eval.n_dev] if t.meta.get("template") in RIVALS]
    for ckpt in args.checkpoints:
        model, tok = load_model(ckpt, "float32", what="checkpoint")
        model.eval()
        margins: dict[str, list[float]] = {}
        for task in tasks:
            right, wrong = RIVALS[task.meta["template"]]
            text = tok.decode(gold_trajectory(tok, env, task).token_ids)
            cut = text.find(f'"relation": "{PREFIX}{right}"') + len(f'"relation": "{PREFIX}')
            prefix_ids = tok(text[:cut], add_special_tokens=False).input_ids
            lp = {rel: completion_logprob(model, prefix_ids, tok(rel + '"}}', add_special_tokens=False).input_ids) for rel in (right, wrong)}
            margins.setdefault(task.meta["template"], []).append(lp[right] - lp[wrong])
        for template, values in sorted(margins.items()):
            print(f"{ckpt}  {template:22s} n={len(values)}  " + " ".join(f"{m:+.1f}" for m in values))


if __name__ == "__main__":
    main()
