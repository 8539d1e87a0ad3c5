"""One GRPO step with every signal on (hints, OPS replace, ETS, PRS), through the real rollout
and train.grpo_update, then an interleaved phase. `rl_step_with_signals` writes the signals'
part of a step out by hand from their building blocks; keel.signals.state.SignalState, which
keel.train.rl_step calls, must give the same step (the last test)."""

from __future__ import annotations

import copy
import random

import torch

from keel.config import Config
from keel.logprobs import collate
from keel.losses import group_advantages
from keel.rollout import SamplingParams, rollout
from keel.rewards import r_binary
from keel.signals.ets import ETSBuffer
from keel.signals.hints import HintPolicy
from keel.signals.ops import expert_members, group_with_experts, sampled_rows
from keel.signals.reflection import RuleAnalyzer, collect_reflections, reflection_example
from keel.signals.schedule import Schedule, run_phase
from keel.types import Source, Task
from test_signals_ops import KG_ENV, kg_task


def _tasks() -> list[Task]:
    a, b = kg_task(), kg_task()
    b.id = "t1"
    return [a, b]


def rl_step_with_signals(model, tok, env, batch_tasks, cfg, signals, state, rl_step, rng, gen):
    """The signals' part of an RL step, written out by hand."""
    s = signals
    n_replace = s.ops.members if s.ops.enabled and s.ops.mode == "replace" else 0
    rows, groups = sampled_rows(batch_tasks, cfg.rollout.group_size, n_replace)
    hints = None
    if state["hints"] is not None:
        per_task = state["hints"].hints_for(batch_tasks)
        hints = [per_task[g] for g in groups]
    params = SamplingParams(temperature=1.0, max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                            max_total_tokens=cfg.rollout.max_total_tokens)
    trajs = rollout(model, tok, env, rows, params, generator=gen, hints=hints, groups=groups)
    for tr, task in zip(trajs, rows):
        tr.reward = r_binary(tr, task)[0]
    # outcomes of the on-policy members, before any expert joins
    group_rewards = [[tr.reward for tr, g in zip(trajs, groups) if g == k] for k in range(len(batch_tasks))]
    ids = [t.id for t in batch_tasks]
    if state["hints"] is not None:
        state["hints"].observe(ids, group_rewards)
    if state["ets"] is not None:
        state["ets"].observe(rl_step, ids, group_rewards)
    if s.ops.enabled:
        experts = [e for k, t in enumerate(batch_tasks) for e in expert_members(tok, env, t, s.ops.members, group=k, cache=state["gold"])]
        expert_rewards = [r_binary(e, batch_tasks[e.group])[0] for e in experts]
        mixed = group_with_experts(trajs, [tr.reward for tr in trajs], experts, expert_rewards, groups, cfg.grpo.scale_by_std)
        members, adv = mixed.trajectories, mixed.advantages
    else:
        members, adv = trajs, group_advantages(torch.tensor([tr.reward for tr in trajs]), torch.tensor(groups), cfg.grpo.scale_by_std)
    if state["analyzer"] is not None:
        shuffled = rng.sample(trajs, len(trajs))  # per_step reflections spread over the batch
        got, _errors = collect_reflections(state["analyzer"], shuffled, state["tasks_by_id"], s.reflection.fail_at, s.reflection.per_step)
        for tr, r in got:
            ex = reflection_example(tok, tr, r.text, s.reflection.max_tokens)
            if ex is not None:
                state["reflections"].append(ex)
        del state["reflections"][: -s.reflection.pool]
    from keel.train import grpo_update

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.grpo.lr)
    stats = grpo_update(model, None, opt, members, adv, cfg.grpo, tok.pad_token_id, 1.0)
    return trajs, members, adv, stats


def test_one_step_with_every_signal_then_an_interleaved_phase(tiny):
    base, tok = tiny
    model = copy.deepcopy(base)
    cfg = Config()
    cfg.rollout.group_size, cfg.rollout.max_turns, cfg.rollout.max_new_tokens, cfg.rollout.max_total_tokens = 3, 2, 8, 4096
    cfg.grpo.lr, cfg.grpo.kl_coef = 1e-4, 0.0
    from keel.signals.schedule import signals_from_dict

    signals = signals_from_dict({"at_steps": [1], "epochs": 1, "batch_size": 4, "lr": 1e-4,
                                 "ops": {"enabled": True, "mode": "replace", "members": 1},
                                 "hint": {"enabled": True, "kinds": ["relation_path"]},
                                 "ets": {"enabled": True, "window": 5},
                                 "reflection": {"enabled": True, "per_step": 3, "pool": 10}})
    schedule = Schedule.from_config(signals, cfg.grpo.lr)
    tasks = _tasks()
    state = {"hints": HintPolicy(KG_ENV, signals.hint.kinds), "ets": ETSBuffer(signals.ets.window, signals.ets.capacity),
             "analyzer": RuleAnalyzer(KG_ENV), "reflections": [], "gold": {}, "tasks_by_id": {t.id: t for t in tasks}}
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    trajs, members, adv, stats = rl_step_with_signals(model, tok, KG_ENV, tasks, cfg, signals, state, 1, rng, gen)

    # 2 sampled rows + 1 gold member per task (replace_num 1 of group 3)
    assert len(trajs) == 4 and len(members) == 6 and stats["loss/trained_members"] == 6.0
    assert all(tr.reward == 0.0 for tr in trajs)  # a random model fails every group ...
    assert adv[4:].tolist() == [adv[4].item()] * 2 and adv[4] > 1.0  # ... so only the experts carry positive advantage
    # every sampled row was hinted, yet no hint token reaches a trained sequence
    assert all(any(x == Source.HINT for x in tr.sources) for tr in trajs)
    batch = collate(members, sources=(Source.POLICY, Source.EXPERT), pad_id=tok.pad_token_id)
    hint_ids = tok.encode("\n\nHint: the answer", add_special_tokens=False)
    for row in batch.input_ids.tolist():
        assert not any(row[i : i + len(hint_ids)] == hint_ids for i in range(len(row)))
    assert state["ets"].task_ids() == ["t0", "t1"] and state["hints"].failed == {"t0", "t1"}  # tracked; used only with only_failed
    assert len(state["reflections"]) == 3 and state["gold"].keys() == {"t0", "t1"}

    phase = schedule.phase_after(1)
    assert phase.sources == ("ets", "reflection")
    examples = state["ets"].sft_examples(tok, KG_ENV, state["tasks_by_id"]) + state["reflections"]
    before = [q.detach().clone() for q in model.parameters()]
    lines = run_phase(model, examples, phase, tok.pad_token_id, 1.0, rng)
    assert len(lines) == 3  # 6 ETS single-step examples + 3 reflections = 9, batches of 4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_signal_state_gives_the_hand_written_step_and_round_trips_its_state(tiny):
    from keel.distributed import DistContext
    from keel.signals.schedule import signals_from_dict
    from keel.signals.state import SignalState

    base, tok = tiny
    cfg = Config()
    cfg.rollout.group_size, cfg.rollout.max_turns, cfg.rollout.max_new_tokens, cfg.rollout.max_total_tokens = 3, 2, 8, 4096
    signals = signals_from_dict({"at_steps": [1], "ops": {"enabled": True, "mode": "replace", "members": 1},
                                 "hint": {"enabled": True, "kinds": ["relation_path"]}, "ets": {"enabled": True, "window": 5},
                                 "reflection": {"enabled": True, "per_step": 3, "pool": 10}})
    tasks = _tasks()
    by_id = {t.id: t for t in tasks}
    state = {"hints": HintPolicy(KG_ENV, signals.hint.kinds), "ets": ETSBuffer(signals.ets.window, signals.ets.capacity),
             "analyzer": RuleAnalyzer(KG_ENV), "reflections": [], "gold": {}, "tasks_by_id": by_id}
    want_trajs, want_members, want_adv, _ = rl_step_with_signals(copy.deepcopy(base), tok, KG_ENV, tasks, cfg, signals, state, 1,
                                                                 random.Random(0), torch.Generator().manual_seed(0))

    sig = SignalState(signals, cfg.grpo.lr, KG_ENV, tok, tasks, by_id, packed=False)
    rng = random.Random(0)
    rows, groups = sampled_rows(tasks, cfg.rollout.group_size, sig.replaced_slots())
    hints, line = sig.hints(tasks, groups)
    params = SamplingParams(temperature=1.0, max_turns=cfg.rollout.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                            max_total_tokens=cfg.rollout.max_total_tokens)
    trajs = rollout(copy.deepcopy(base), tok, KG_ENV, rows, params, generator=torch.Generator().manual_seed(0), hints=hints, groups=groups)
    for tr, task in zip(trajs, rows):
        tr.reward = r_binary(tr, task)[0]
    group_rewards = [[tr.reward for tr, g in zip(trajs, groups) if g == k] for k in range(len(tasks))]
    line.update(sig.observe(1, [t.id for t in tasks], group_rewards))
    members, adv, ops_line = sig.members(trajs, torch.tensor([tr.reward for tr in trajs]), groups, tasks, [0, 1],
                                         lambda tr, task: r_binary(tr, task), cfg.grpo, DistContext())
    line.update(ops_line)
    line.update(sig.reflect(trajs, rng))

    assert [tr.token_ids for tr in trajs] == [tr.token_ids for tr in want_trajs]
    assert [tr.token_ids for tr in members] == [tr.token_ids for tr in want_members] and torch.equal(adv, want_adv)
    assert line == {"signal/hinted_groups": 1.0, "signal/ets_buffer": 2.0, "signal/ops_members": 2,
                    "signal/reflections": 3.0, "signal/reflection_errors": 0.0}
    assert sig.old_from_policy(members, other_sampler=False) == [True] * 4 + [False] * 2  # hinted sampled rows; gold members are not hinted
    saved = sig.state_dict()
    assert saved["ets"]["entries"] == [["t0", 1], ["t1", 1]] and saved["hints"] == {"failed": ["t0", "t1"]}
    assert [r[0] for r in saved["reflections"]] == [e.token_ids for e in state["reflections"]]
    assert [e.token_ids for e in sig.supervision_pool("ets")] == [e.token_ids for e in state["ets"].sft_examples(tok, KG_ENV, by_id)]

    resumed = SignalState(signals, cfg.grpo.lr, KG_ENV, tok, tasks, by_id, packed=False)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    assert [e.token_ids for e in resumed.supervision_pool("reflection")] == [e.token_ids for e in state["reflections"]]
