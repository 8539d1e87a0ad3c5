"""OPS: advantages over on- and off-policy members (hand arithmetic), gold members for KG and
function calling, and "replace" = every sampled turn overwritten by the gold turn."""

from __future__ import annotations

import copy

import pytest
import torch

from keel.fc.learnable import LearnableEnv, generate_tasks
from keel.kg.env import KGEnv
from keel.kg.store import MemoryStore
from keel.rewards import fc_binary, r_binary
from keel.rollout import SamplingParams, rollout
from keel.sft import gold_texts, gold_trajectory
from keel.signals.ops import as_expert, expert_members, gold_steer, group_with_experts, sampled_rows
from keel.types import Source, Task, Trajectory

TRIPLES = [
    ("m.film", "film.film.directed_by", "m.bob"),
    ("m.film", "film.film.starring", "m.alice"),
    ("m.bob", "people.person.place_of_birth", "m.paris"),
    ("m.alice", "people.person.place_of_birth", "m.rome"),
]
NAMES = {"m.film": "Heat", "m.bob": "Bob Vance", "m.alice": "Alice", "m.paris": "Paris", "m.rome": "Rome"}
KG_ENV = KGEnv(MemoryStore.from_triples(TRIPLES, NAMES))


def kg_task(relation: str = "film.film.directed_by") -> Task:
    return Task(
        id="t0",
        question="Where was the director of Heat born?",
        answers=["Paris"],
        topic_entities={"m.film": "Heat"},
        gold_turns=[
            [{"name": "get_tail_entities", "arguments": {"entity": "m.film", "relation": relation}}],
            [{"name": "get_tail_entities", "arguments": {"entity": "m.bob", "relation": "people.person.place_of_birth"}}],
        ],
        gold_triples=[("m.film", "film.film.directed_by", "m.bob"), ("m.bob", "people.person.place_of_birth", "m.paris")],
    )


def _member(group: int, expert: bool = False) -> Trajectory:
    src = Source.EXPERT if expert else Source.POLICY
    return Trajectory(task_id=f"g{group}", token_ids=[1, 2, 3], sources=[0, int(src), int(src)], logprobs=[0.0] * 3, group=group)


def test_advantages_over_on_and_off_policy_members_by_hand():
    trajs = [_member(0), _member(0), _member(0), _member(1), _member(1), _member(1)]
    experts = [_member(0, True), _member(1, True)]
    mixed = group_with_experts(trajs, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0], experts, [1.0, 1.0], [0, 0, 0, 1, 1, 1])
    assert mixed.groups.tolist() == [0, 0, 0, 1, 1, 1, 0, 1]
    assert mixed.is_expert == [False] * 6 + [True] * 2
    # group 0: rewards [0, 0, 1 | 1]: mean 0.5, unbiased std sqrt(4 · 0.25 / 3) = 0.57735 → ±0.5 / 0.577351 = ±0.866024
    # group 1: rewards [0, 0, 0 | 1]: mean 0.25, centred [-0.25 ×3, 0.75], std sqrt((3 · 0.0625 + 0.5625) / 3) = 0.5
    #          → [-0.5, -0.5, -0.5, 1.5] (÷ (0.5 + 1e-6)); without the expert this group's advantages are all 0
    expected = torch.tensor([-0.866024, -0.866024, 0.866024, -0.5, -0.5, -0.5, 0.866024, 1.5])
    assert torch.allclose(mixed.advantages, expected, atol=2e-6)
    plain = group_with_experts(trajs, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0], experts, [1.0, 1.0], [0, 0, 0, 1, 1, 1], scale_by_std=False)
    assert torch.allclose(plain.advantages, torch.tensor([-0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.5, 0.75]))


def test_group_with_experts_rejects_bad_input():
    trajs, groups = [_member(0), _member(0)], [0, 0]
    with pytest.raises(ValueError, match="names group 5, which has no on-policy member"):
        group_with_experts(trajs, [0.0, 1.0], [_member(5, True)], [1.0], groups)
    with pytest.raises(ValueError, match="2 trajectories, 3 rewards"):
        group_with_experts(trajs, [0.0, 1.0, 1.0], [], [], groups)
    with pytest.raises(ValueError, match="1 experts but 2 expert rewards"):
        group_with_experts(trajs, [0.0, 1.0], [_member(0, True)], [1.0, 0.0], groups)
    with pytest.raises(ValueError, match="has no EXPERT tokens"):
        group_with_experts(trajs, [0.0, 1.0], [_member(0)], [1.0], groups)


def test_sampled_rows_leave_the_replaced_slots_free():
    a, b = Task(id="a", question="", answers=["x"]), Task(id="b", question="", answers=["y"])
    rows, groups = sampled_rows([a, b], group_size=3, replace_num=1)
    assert [t.id for t in rows] == ["a", "a", "b", "b"] and groups == [0, 0, 1, 1]
    assert len(sampled_rows([a], 8, 0)[0]) == 8
    with pytest.raises(ValueError, match=r"must be in \[0, group_size=2\)"):
        sampled_rows([a], 2, 2)


def test_expert_members_kg(tiny):
    _, tok = tiny
    members = expert_members(tok, KG_ENV, kg_task(), k=2, group=3)
    assert len(members) == 2 and all(m.group == 3 for m in members)
    m = members[0]
    assert m.info["gold_ok"] and m.answer == "Paris" and m.finished
    assert len(m.turn_spans) == 3 and m.num_policy_tokens == 0
    assert all(s == Source.EXPERT for a, b in m.turn_spans for s in m.sources[a:b])
    assert [s.observation.text for s in m.steps] == ['["Bob Vance (m.bob)"]', '["Paris (m.paris)"]']
    assert r_binary(m, kg_task())[0] == 1.0
    members[0].token_ids[0] = -1  # copies, not one object twice
    assert members[1].token_ids[0] != -1
    # a gold path that fails in the env gives no member (imitating it would teach the failure)
    assert expert_members(tok, KG_ENV, kg_task("film.film.no_such_relation"), k=1) == []
    assert expert_members(tok, KG_ENV, kg_task(), k=0) == []
    with pytest.raises(ValueError, match="members must be >= 0"):
        expert_members(tok, KG_ENV, kg_task(), k=-1)


def test_expert_trajectory_function_calling_is_scored_by_bfcl(tiny):
    _, tok = tiny
    env = LearnableEnv()
    task = generate_tasks(1, seed=0)[0]  # math: add, then "multiply that result by 8"
    assert gold_texts(task, env) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 51, "b": 99}}\n</tool_call>',
        "I have finished the requested operations.",
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 150, "b": 8}}\n</tool_call>',
        "I have finished the requested operations.",
    ]
    gold = gold_trajectory(tok, env, task)
    assert gold.info["gold_ok"] and gold.info["checker_valid"] is True and gold.finished
    assert fc_binary(gold, task) == (1.0, {"valid": 1.0})
    assert [s.observation.text for s in gold.steps] == ['{"result": 150}', '{"result": 1200}']
    # the second user message sits between assistant turns 2 and 3, as the env supplies it
    assert "Now multiply that result by 8." in tok.decode(gold.token_ids[gold.turn_spans[1][1] : gold.turn_spans[2][0]])


@pytest.mark.parametrize("kind", ["kg", "fc"])
def test_replace_equals_every_turn_overwritten_by_gold(tiny, kind):
    """The authors' replace_num=1: forcing the gold turn into every turn of a live rollout gives,
    token for token, the offline gold trajectory that Keel puts into the freed slot."""
    model, tok = tiny
    env, task = (KG_ENV, kg_task()) if kind == "kg" else (LearnableEnv(), generate_tasks(1, seed=0)[0])
    rows = [task, task]
    params = SamplingParams(temperature=1.0, max_turns=6, max_new_tokens=64, max_total_tokens=4096)
    out = rollout(model, tok, env, rows, params, generator=torch.Generator().manual_seed(0), steer=gold_steer(tok, env, rows, [0]), groups=[0, 0])
    gold = gold_trajectory(tok, env, task)
    replaced = as_expert(out[0])
    assert replaced.token_ids == gold.token_ids
    assert replaced.sources == gold.sources
    assert replaced.turn_spans == gold.turn_spans and replaced.answer == gold.answer
    assert out[0].info.get("checker_valid", True) == gold.info.get("checker_valid", True)
    assert all(lp == 0.0 for lp in replaced.logprobs) and replaced.num_policy_tokens == 0
    assert out[1].token_ids != gold.token_ids  # the other row sampled freely


def test_ops_update_raises_the_gold_turns_log_prob(tiny):
    """One real grpo_update on a group that failed entirely plus its gold member: the expert's
    advantage is +1.5 (see the hand arithmetic), so its turns become more likely."""
    from keel.config import Config
    from keel.logprobs import collate, token_logprobs
    from keel.train import grpo_update

    base, tok = tiny
    model = copy.deepcopy(base)
    params = SamplingParams(temperature=1.0, max_turns=2, max_new_tokens=6, max_total_tokens=2048)
    task = kg_task()
    sampled = rollout(model, tok, KG_ENV, [task] * 3, params, generator=torch.Generator().manual_seed(1), groups=[0, 0, 0])
    experts = expert_members(tok, KG_ENV, task, k=1, group=0)
    mixed = group_with_experts(sampled, [0.0, 0.0, 0.0], experts, [1.0], [0, 0, 0])
    assert torch.allclose(mixed.advantages[-1], torch.tensor(1.5), atol=1e-5)

    def expert_logprob() -> float:
        b = collate([experts[0]], sources=(Source.EXPERT,), pad_id=tok.pad_token_id)
        with torch.no_grad():
            return float(token_logprobs(model, b.input_ids, b.attention_mask, b.target_mask)[0].sum())

    cfg = Config()
    cfg.grpo.lr, cfg.grpo.kl_coef = 1e-3, 0.0
    before = expert_logprob()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.grpo.lr)
    stats = grpo_update(model, None, opt, mixed.trajectories, mixed.advantages, cfg.grpo, tok.pad_token_id, 1.0)
    assert stats["loss/trained_members"] == 4.0
    assert expert_logprob() > before + 1.0
