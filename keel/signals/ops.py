"""Off-policy supervision (OPS, paper A): gold trajectories join the GRPO group as members.

Paper A (Eq. 4–5) adds expert trajectories to a prompt's group, normalises the advantage over
on- and off-policy members together, and applies the same clipped surrogate to both with the
same importance ratio. In the authors' code (`replace_num=1`) one of the n=8 rollouts has each
generated turn overwritten by the gold action, so the group keeps n members.

How Keel realises both (token-in/token-out):
- "add" (Eq. 4): `expert_members` builds k gold trajectories (`keel.sft.gold_trajectory`,
  assistant tokens `Source.EXPERT`); `group_with_experts` appends them to the group and
  computes advantages over all n + k members with `keel.losses.group_advantages`.
- "replace" (their code): overwriting every generated turn by the gold turn means the turn's
  ids become the gold text's ids closed by <|im_end|>, the env then executes the gold calls, so
  the tool response is the gold one, and the next turn is overwritten again. The result is,
  token for token, the gold trajectory: tests/test_signals_ops.py forces the gold turns into a
  live rollout through `rollout(steer=gold_steer(...))` and checks the ids equal
  `gold_trajectory`'s. So Keel samples n − replace_num members (`sampled_rows`) and puts the
  offline gold trajectory in the freed slot — the same group, without decoding tokens that
  would be thrown away. (`gold_steer` + `as_expert` do it inside the rollout, when wanted.)
- train.py's `grpo_update` trains POLICY and EXPERT tokens and gives EXPERT tokens the
  current policy's detached log-prob as "old" (ratio 1 at the step), as verl does when it
  recomputes old log-probs with the actor.
Departure: gold trajectories for function calling close each user turn with a fixed message
(`keel.fc.policies.DONE_TEXT`), as Keel's oracle does; BFCL's gold has no closing text.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from keel import metrics as M
from keel.chat import IM_END
from keel.config import SignalsConfig
from keel.distributed import all_reduce_sum
from keel.losses import group_advantages
from keel.sft import cached_gold_trajectory, gold_texts
from keel.signals.base import Signal
from keel.types import Env, Source, Task, Trajectory


def expert_members(tokenizer, env: Env, task: Task, k: int = 1, group: int = -1, cache: dict[str, Trajectory] | None = None) -> list[Trajectory]:
    """k gold trajectories of `task` to join GRPO group `group`; [] when the gold path fails in
    the env (`gold_ok` False: imitating a failing path would teach the failure) or k = 0.
    `cache` (task id -> gold trajectory) saves replaying the same gold path at every step."""
    if k < 0:
        raise ValueError(f"signals.ops.members must be >= 0, got {k}")
    if k == 0:
        return []
    gold = cached_gold_trajectory(tokenizer, env, task, cache)
    if not gold.info.get("gold_ok", True):
        return []
    out = []
    for _ in range(k):
        member = copy.deepcopy(gold)
        member.group = group
        out.append(member)
    return out


def sampled_rows(batch_tasks: Sequence[Task], group_size: int, replace_num: int = 0) -> tuple[list[Task], list[int]]:
    """(rows, group ids) to roll out: `group_size - replace_num` rows per task.

    With replace_num = 1 and group_size 8 (the authors' setting), 7 rows are sampled and the gold
    trajectory takes the 8th slot. Worked example: tasks [a, b], group_size 3, replace_num 1 →
    rows [a, a, b, b], groups [0, 0, 1, 1].
    """
    if not 0 <= replace_num < group_size:
        raise ValueError(f"signals.ops.members (replace mode) must be in [0, group_size={group_size}), got {replace_num}")
    n = group_size - replace_num
    rows = [t for t in batch_tasks for _ in range(n)]
    groups = [k for k in range(len(batch_tasks)) for _ in range(n)]
    return rows, groups


@dataclass
class MixedGroups:
    """On-policy members followed by expert members: trajectories [M], rewards [M], groups [M],
    advantages [M] (normalised per group over both kinds), is_expert [M]."""

    trajectories: list[Trajectory]
    rewards: torch.Tensor
    groups: torch.Tensor
    advantages: torch.Tensor
    is_expert: list[bool]


def group_with_experts(
    trajs: Sequence[Trajectory],
    rewards: Sequence[float] | torch.Tensor,
    experts: Sequence[Trajectory],
    expert_rewards: Sequence[float] | torch.Tensor,
    groups: Sequence[int] | torch.Tensor,
    scale_by_std: bool = True,
) -> MixedGroups:
    """Paper A's Eq. 4: each expert joins the group named by its `.group`, and advantages are
    normalised over on- and off-policy members together.

    Worked example (one group, scale_by_std): on-policy rewards [0, 0, 0] + expert 1 →
    mean 0.25, centred [-0.25, -0.25, -0.25, 0.75], unbiased std sqrt(0.75 / 3) = 0.5 →
    advantages [-0.5, -0.5, -0.5, 1.5]: a group that failed entirely (advantage 0 without the
    expert) now pushes towards the gold turns and away from the sampled ones.
    """
    rewards_t = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    expert_t = torch.as_tensor(expert_rewards, dtype=torch.float32).reshape(-1)
    groups_t = torch.as_tensor(groups, dtype=torch.long).reshape(-1)
    if not (len(trajs) == rewards_t.numel() == groups_t.numel()):
        raise ValueError(f"group_with_experts: {len(trajs)} trajectories, {rewards_t.numel()} rewards, {groups_t.numel()} group ids")
    if len(experts) != expert_t.numel():
        raise ValueError(f"group_with_experts: {len(experts)} experts but {expert_t.numel()} expert rewards")
    known = set(groups_t.tolist())
    for e in experts:
        if e.group not in known:
            raise ValueError(f"group_with_experts: expert for task {e.task_id!r} names group {e.group}, which has no on-policy member")
        if not any(s == Source.EXPERT for s in e.sources):
            raise ValueError(f"group_with_experts: trajectory for task {e.task_id!r} has no EXPERT tokens")
    all_rewards = torch.cat([rewards_t, expert_t])
    all_groups = torch.cat([groups_t, torch.tensor([e.group for e in experts], dtype=torch.long)])
    adv = group_advantages(all_rewards, all_groups, scale_by_std)
    return MixedGroups(list(trajs) + list(experts), all_rewards, all_groups, adv, [False] * len(trajs) + [True] * len(experts))


class OPS(Signal):
    """`signals.ops`: gold members in every GRPO group ("replace": they take `members` of the
    group_size slots, so fewer rows are sampled; "add": they join the sampled ones), with
    advantages over both kinds (Eq. 4)."""

    @staticmethod
    def enabled(cfg: SignalsConfig) -> bool:
        return cfg.ops.enabled

    def replaced_slots(self) -> int:
        return self.cfg.ops.members if self.cfg.ops.mode == "replace" else 0

    def members(self, local, rewards, groups, batch_tasks, mine, reward_fn, grpo, ctx):
        """Each of this rank's groups (`mine`) gains its gold members; signal/ops_members counts them over all ranks."""
        experts = [e for k in mine for e in expert_members(self.ctx.tokenizer, self.ctx.env, batch_tasks[k], self.cfg.ops.members,
                                                           group=k, cache=self.ctx.gold_cache)]
        expert_rewards = [reward_fn(e, batch_tasks[e.group])[0] for e in experts]
        mixed = group_with_experts(local, rewards, experts, expert_rewards, groups, grpo.scale_by_std)
        return mixed.trajectories, mixed.advantages, {M.SIGNAL_OPS_MEMBERS: all_reduce_sum([len(experts)], ctx)[0]}


# --- "replace" inside a live rollout ----------------------------------------------------------------


def gold_steer(tokenizer, env: Env, rows: Sequence[Task], replace: Sequence[int]) -> Callable[[int, int], list[int] | None]:
    """A `rollout(steer=...)` function that overwrites every turn of the rows in `replace` with
    the gold turn's ids (the gold text's ids + <|im_end|>, as `gold_trajectory` encodes them).
    The rollout's `max_new_tokens` must fit the longest gold turn (a KG call is ~50 tokens),
    or the forced turn is cut there like any other."""
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    forced = {i: [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in gold_texts(rows[i], env)] for i in replace}

    def steer(row: int, turn: int) -> list[int] | None:
        turns = forced.get(row)
        return turns[turn] if turns is not None and turn < len(turns) else None

    return steer


def as_expert(traj: Trajectory) -> Trajectory:
    """A copy whose POLICY tokens are EXPERT (not sampled: their log-probs are zeroed, and
    grpo_update uses the current policy's as "old")."""
    out = copy.deepcopy(traj)
    out.sources = [int(Source.EXPERT) if s == Source.POLICY else s for s in out.sources]
    out.logprobs = [0.0] * len(out.logprobs)
    out.info["expert"] = True
    return out
