"""How far Keel's R-stepwise word rule is from the released one, on random and perturbed episodes.

Usage: python scripts/stepwise_rule_gap.py [--n 400] [--seed 0] [--policy mixed|random|oracle]

Episodes are played on the seeded synthetic KG (`keel.kg.synth`, seed 0, train split) through
the real KGEnv (paper B's interface: ids shown as "Name (m.id)"), by a random policy of 1–5 calls: each call is, with equal chance, the next gold
call; the next gold call perturbed (the entity respelled as " id " or "Name (id)", or replaced
by another entity seen so far, or the relation replaced by a random one); or a random verb on
an entity seen so far (topic entities and returned entities) with a random relation
(`--policy random`: always the last kind; `--policy oracle`: the gold walk of
`keel.kg.oracle`, once per dev question, whatever `--n`). The answer is the gold answer, the first entity of the last non-empty result, a random entity
name, or none, with equal chance. Each episode is scored by `r_stepwise` and
`r_stepwise_released`; the script prints the share of episodes where the two totals (and the
step means r_step) differ, the mean difference on those and overall, and which component moved.
The numbers quoted in `keel.rewards.r_stepwise_released` come from the default arguments.
"""

from __future__ import annotations

import argparse
import random

from keel.kg import synth
from keel.kg.base import VERBS
from keel.kg.env import KGEnv, KGEnvConfig
from keel.episode import run_text_episode
from keel.kg.oracle import oracle_policy, parse_observation
from keel.rewards import r_stepwise, r_stepwise_released
from keel.types import Step, ToolCall, Trajectory


def random_episode(env: KGEnv, kg, task, rng: random.Random, random_only: bool = False) -> Trajectory:
    relations = list(kg.store.relations())
    gold = [c for turn in task.gold_turns for c in turn]
    seen: list[tuple[str, str]] = [(e, n) for e, n in task.topic_entities.items()]
    episode = env.start(task)
    steps: list[Step] = []
    last_items: list[tuple[str, str]] = []
    for i in range(rng.randint(1, 5)):
        kind = "random" if random_only else rng.choice(("gold", "perturbed", "random"))
        if kind != "random" and i < len(gold):
            verb, args = gold[i]["name"], dict(gold[i]["arguments"])
            if kind == "perturbed":
                what = rng.choice(("spaces", "display", "entity", "relation"))
                entity = args["entity"]
                if what == "spaces":
                    args["entity"] = f" {entity} "
                elif what == "display" and kg.store.name(entity):
                    args["entity"] = f"{kg.store.name(entity)} ({entity})"
                elif what == "entity":
                    args["entity"] = rng.choice(seen)[0]
                elif "relation" in args:
                    args["relation"] = rng.choice(relations)
        else:
            verb = rng.choice(VERBS)
            args = {"entity": rng.choice(seen)[0]}
            if verb.endswith("_entities"):
                args["relation"] = rng.choice(relations)
        call = ToolCall(name=verb, arguments=args)
        obs = episode.execute(call)
        steps.append(Step(turn=i, call=call, observation=obs))
        items = parse_observation(obs.result_text)
        if items:
            last_items = items
            seen.extend(items)
    choice = rng.randrange(4)
    if choice == 0:
        answer = task.answers[0] if task.answers else ""
    elif choice == 1:
        answer = last_items[0][1] if last_items else ""
    elif choice == 2:
        answer = kg.store.name(rng.choice(kg.people + kg.films + kg.cities)) or ""
    else:
        answer = None
    return Trajectory(task_id=task.id, token_ids=[], sources=[], logprobs=[], steps=steps, answer=answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", choices=("mixed", "random", "oracle"), default="mixed")
    a = ap.parse_args()
    kg, splits = synth.generate_splits(seed=0)
    env = KGEnv(kg.store, KGEnvConfig())
    rng = random.Random(a.seed)
    if a.policy == "oracle":
        episodes = [(t, run_text_episode(env, t, oracle_policy, max_turns=6).to_trajectory()) for t in splits["dev"]]
    else:
        episodes = []
        for _ in range(a.n):
            task = rng.choice(splits["train"])
            episodes.append((task, random_episode(env, kg, task, rng, a.policy == "random")))
    diffs, step_diffs, moved = [], [], {"on_path": 0, "progress": 0, "coherence": 0, "valid": 0}
    for task, traj in episodes:
        total_k, c_k = r_stepwise(traj, task)
        total_r, c_r = r_stepwise_released(traj, task)
        diffs.append(total_k - total_r)
        step_diffs.append(c_k["r_step"] - c_r["r_step"])
        for k in moved:
            moved[k] += abs(c_k[k] - c_r[k]) > 1e-12
    n = len(diffs)
    differ = [d for d in diffs if abs(d) > 1e-12]
    step_differ = [d for d in step_diffs if abs(d) > 1e-12]
    print(f"episodes {n} (policy {a.policy}, seed {a.seed})")
    print(f"total differs: {len(differ)}/{n} = {len(differ) / n:.1%}; Keel higher in {sum(d > 0 for d in differ)}, lower in {sum(d < 0 for d in differ)}")
    if differ:
        print(f"  mean (Keel - released) on those: {sum(differ) / len(differ):+.3f}; max {max(differ):+.3f}; over all episodes: {sum(diffs) / n:+.3f}")
    print(f"r_step differs: {len(step_differ)}/{n} = {len(step_differ) / n:.1%}")
    if step_differ:
        print(f"  mean r_step (Keel - released) on those: {sum(step_differ) / len(step_differ):+.3f}; over all: {sum(step_diffs) / n:+.3f}")
    print("episodes whose component mean differs: " + ", ".join(f"{k} {v}" for k, v in moved.items()))


if __name__ == "__main__":
    main()
