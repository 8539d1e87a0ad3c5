"""Data-parallel GRPO: two gloo processes, each updating on half of a step's groups, end with the
same weights as one process updating on the whole batch (2 AdamW steps, clipping active), and
plain DDP averaging does not; plus the helper's small pieces by hand."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from fakes import EchoEnv, make_tasks
from runs import free_port
from keel import metrics as M
from keel.config import Config
from keel.distributed import (
    DistContext,
    GradientSync,
    all_reduce_sum,
    broadcast_parameters,
    init_distributed,
    local_grpo,
    loss_normaliser,
    reduce_stats,
    shard_groups,
)
from keel.losses import group_advantages
from keel.rollout import SamplingParams, rollout
from keel.train import grpo_update
from keel.types import Trajectory

GROUPS, GROUP_SIZE, STEPS = 4, 2, 2
MAX_GRAD_NORM = 0.05  # below the gradient norms of these batches (asserted), so clipping acts
# Per step, rewards per member. Group 1 of step 0 is uniform (trained by no one), so rank 0
# trains one group and rank 1 two: the ranks' token counts differ, which is what makes plain
# averaging wrong.
REWARDS = ([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])


def _batches(tiny) -> list[tuple[list[Trajectory], torch.Tensor]]:
    model, tok = tiny
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)

    answer = tok.encode("<answer>item1</answer><|im_end|>", add_special_tokens=False)

    def steer(row, turn):  # ragged rows: a call then 24 free tokens, a short answer, or 24 free tokens
        if turn == 0 and row % 3 < 2:
            return call if row % 3 == 0 else answer
        return None

    out = []
    groups = [g for g in range(GROUPS) for _ in range(GROUP_SIZE)]
    for step in range(STEPS):
        tasks = [t for t in make_tasks(GROUPS) for _ in range(GROUP_SIZE)]
        trajs = rollout(model, tok, EchoEnv(), tasks, SamplingParams(max_turns=2, max_new_tokens=32), generator=torch.Generator().manual_seed(10 + step), steer=steer, groups=groups)
        out.append((trajs, group_advantages(torch.tensor(REWARDS[step]), torch.tensor(groups))))
    return out


def _config(aggregation: str) -> Config:
    cfg = Config()
    cfg.grpo.loss_aggregation = aggregation
    cfg.grpo.micro_batch_size = 2  # several micro-batches per rank: accumulation and reduction compose
    cfg.grpo.kl_coef = 0.1  # the KL term must be weighted like the policy term
    cfg.grpo.max_grad_norm = MAX_GRAD_NORM
    return cfg


def _one_process(state, ref_state, batches, aggregation, pad_id, tiny_config):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config)
    model.load_state_dict(state)
    ref = LlamaForCausalLM(tiny_config)
    ref.load_state_dict(ref_state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    norms = []
    for trajs, adv in batches:
        stats = grpo_update(model, ref, opt, trajs, adv, _config(aggregation).grpo, pad_id, 1.0)
        norms.append(stats[M.LOSS_GRAD_NORM])
    return model.state_dict(), norms


def _worker(rank, world, port, state, ref_state, batches, pad_id, tiny_config, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    ctx = init_distributed()
    assert ctx == DistContext(rank, world, rank)
    try:
        results = {}
        for aggregation in ("token-mean", "seq-mean-token-mean"):
            for weighting in ("exact", "ddp-average"):
                model = LlamaForCausalLM(tiny_config)
                model.load_state_dict(state)
                if rank == 1:  # a different start on rank 1: broadcast_parameters must undo it
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(1.0)
                broadcast_parameters(model, ctx)
                ref = LlamaForCausalLM(tiny_config)
                ref.load_state_dict(ref_state)
                cfg = _config(aggregation)
                sync = GradientSync(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4), model.parameters(), ctx, cfg.grpo.max_grad_norm)
                for trajs, adv in batches:
                    mine = shard_groups(GROUPS, ctx)
                    rows = [i for i, tr in enumerate(trajs) if tr.group in mine]
                    local_trajs, local_adv = [trajs[i] for i in rows], adv[rows]
                    n_local = loss_normaliser(local_trajs, local_adv, aggregation)
                    n_global = all_reduce_sum([n_local], ctx)[0]
                    sync.begin(n_local / n_global if weighting == "exact" else 1.0 / world)
                    grpo_update(model, ref, sync, local_trajs, local_adv, local_grpo(cfg.grpo), pad_id, 1.0)
                    sync.commit()
                results[(aggregation, weighting)] = model.state_dict()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_two_processes_match_one_process(tiny, tmp_path):
    model, tok = tiny
    batches = _batches(tiny)
    # Step 2's old log-probs are the initial model's: ratios ≠ 1 after step 1, so clipping of the
    # surrogate is exercised as well as gradient clipping.
    torch.manual_seed(5)
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a reference ≠ policy: the KL term has a gradient
    state, ref_state = copy.deepcopy(model.state_dict()), copy.deepcopy(ref_model.state_dict())
    world = 2
    mp.start_processes(_worker, args=(world, free_port(), state, ref_state, batches, tok.pad_token_id, model.config, str(tmp_path)), nprocs=world, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        expected, norms = _one_process(state, ref_state, batches, aggregation, tok.pad_token_id, model.config)
        assert min(norms) > MAX_GRAD_NORM, norms  # clipping really acted in both steps
        exact = [r[(aggregation, "exact")] for r in ranks]
        naive = ranks[0][(aggregation, "ddp-average")]
        moved = max((expected[k] - state[k]).abs().max().item() for k in state)
        assert moved > 1e-2  # two AdamW steps at lr 1e-2 moved the weights by up to ~2e-2
        # AdamW's eps is 1e-4, not 1e-8: with eps 1e-8 its first steps are ≈ lr·g/|g| and turn
        # fp32 summation-order noise of near-zero gradient entries into differences up to 6e-4
        # (measured); with 1e-4 the two runs agree to 3e-7 (measured) while moving 1e-2.
        for k in expected:
            assert torch.equal(exact[0][k], exact[1][k]), k  # ranks hold identical weights
            assert torch.allclose(exact[0][k], expected[k], atol=2e-6, rtol=0), (aggregation, k, (exact[0][k] - expected[k]).abs().max())
        # plain DDP averaging weighs rank 0's tokens differently: measurably different weights
        assert max((naive[k] - expected[k]).abs().max().item() for k in expected) > 1e-3  # measured 1.7e-2


def test_gradient_sync_alone_equals_grpo_update(tiny):
    """World size 1: GradientSync (deferred step, global clip) is the plain update exactly."""
    model, tok = tiny
    trajs, adv = _batches(tiny)[0]
    cfg = _config("token-mean")
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    stats_a = grpo_update(a, None, opt_a, trajs, adv, cfg.grpo, tok.pad_token_id, 1.0)
    sync = GradientSync(torch.optim.AdamW(b.parameters(), lr=1e-2), b.parameters(), DistContext(), cfg.grpo.max_grad_norm)
    sync.begin(1.0)
    stats_b = grpo_update(b, None, sync, trajs, adv, local_grpo(cfg.grpo), tok.pad_token_id, 1.0)
    stats_b.update(sync.commit())
    assert stats_b[M.LOSS_GRAD_NORM] == pytest.approx(stats_a[M.LOSS_GRAD_NORM], rel=1e-6)
    assert stats_b[M.LOSS_POLICY] == pytest.approx(stats_a[M.LOSS_POLICY], rel=1e-6)
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-7, rtol=0), k


def test_gradient_sync_skips_nonfinite_and_empty_steps(tiny):
    model, tok = tiny
    trajs, adv = _batches(tiny)[0]
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sync = GradientSync(torch.optim.AdamW(m.parameters(), lr=1e-2), m.parameters(), DistContext(), 1.0)
    bad = adv.clone()
    bad[0] = float("nan")
    sync.begin(1.0)
    grpo_update(m, None, sync, trajs, bad, local_grpo(Config().grpo), tok.pad_token_id, 1.0)
    assert sync.commit() == {M.LOSS_GRAD_NORM: 0.0, M.LOSS_SKIPPED: 1.0}
    sync.begin(1.0)  # no member has an advantage: grpo_update neither steps nor zeroes
    grpo_update(m, None, sync, trajs, torch.zeros(len(trajs)), local_grpo(Config().grpo), tok.pad_token_id, 1.0)
    assert sync.commit() == {M.LOSS_GRAD_NORM: 0.0, M.LOSS_SKIPPED: 0.0}
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k  # AdamW with zero grads would still move (decay, moments)


def test_shard_groups_by_hand():
    # 8 groups on 2 ranks: 0..3 and 4..7; on 4 ranks rank 3 gets 6..7
    assert shard_groups(8, DistContext(0, 2)) == range(0, 4)
    assert shard_groups(8, DistContext(1, 2)) == range(4, 8)
    assert shard_groups(8, DistContext(3, 4)) == range(6, 8)
    assert shard_groups(3, DistContext()) == range(0, 3)
    with pytest.raises(ValueError, match="prompts_per_step=6 is not a multiple of the 4 processes; use 8"):
        shard_groups(6, DistContext(0, 4))
    with pytest.raises(ValueError, match="0 groups"):
        shard_groups(0, DistContext())


def test_loss_normaliser_by_hand():
    a = Trajectory("a", token_ids=[9] * 5, sources=[0, 1, 1, 2, 1], logprobs=[0.0] * 5)
    b = Trajectory("b", token_ids=[9] * 3, sources=[0, 4, 1], logprobs=[0.0] * 3)
    adv = torch.tensor([0.5, 0.0])
    # a: policy tokens at 1, 2, 4 → 3; b is skipped (advantage 0)
    assert loss_normaliser([a, b], adv, "token-mean") == 3
    assert loss_normaliser([a, b], adv, "seq-mean-token-mean") == 1
    # not skipping: b adds its expert and policy token → 5 tokens, 2 sequences
    assert loss_normaliser([a, b], adv, "token-mean", skip_zero_advantage=False) == 5
    assert loss_normaliser([a, b], adv, "seq-mean-token-mean", skip_zero_advantage=False) == 2
    with pytest.raises(ValueError, match="'mean' is not"):
        loss_normaliser([a], adv[:1], "mean")
    with pytest.raises(ValueError, match="2 trajectories but 1 advantages"):
        loss_normaliser([a, b], adv[:1], "token-mean")


def test_reduce_stats_and_sums_alone():
    stats = {M.LOSS_POLICY: 0.4, M.TOKENS_ENTROPY: 2.0, M.LOSS_TRAINED_MEMBERS: 3.0, M.LOSS_GRAD_NORM: 7.0}
    # one rank holding 30 of 40 tokens: losses and per-token means are weighted, counts kept
    out = reduce_stats(stats, loss_weight=0.75, token_weight=0.75, ctx=DistContext())
    assert out[M.LOSS_POLICY] == pytest.approx(0.3) and out[M.TOKENS_ENTROPY] == pytest.approx(1.5)
    assert out[M.LOSS_TRAINED_MEMBERS] == 3.0 and out[M.LOSS_GRAD_NORM] == 7.0
    assert all_reduce_sum([1, 2.5], DistContext()) == [1.0, 2.5]


def test_init_distributed_reads_the_launcher_environment(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert init_distributed() == DistContext(0, 1, 0) and init_distributed().is_main
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2 is not within WORLD_SIZE=2"):
        init_distributed()


def test_gradient_sync_rejects_bad_weight(tiny):
    model, _ = tiny
    sync = GradientSync(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), DistContext(), 1.0)
    for w in (math.nan, -0.5, math.inf):
        with pytest.raises(ValueError, match="weight"):
            sync.begin(w)


def _advantage_worker(rank, world, port, rewards, groups, group_size, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    from keel.distributed import advantages

    ctx = init_distributed()
    try:
        cfg = Config()
        cfg.grpo.baseline = "batch"
        mine = shard_groups(len(rewards) // group_size, ctx)
        rows = [i for i, k in enumerate(groups) if k in mine]
        torch.save((rows, advantages(rewards[rows], [groups[i] for i in rows], cfg.grpo, ctx)), os.path.join(out_dir, f"adv{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_batch_baseline_is_one_baseline_over_all_ranks(tmp_path):
    """grpo.baseline=batch on two ranks: each rank's advantages are those of one process over the
    whole batch (the mean and std are all-reduced), not of its own half."""
    from keel.distributed import advantages

    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # group 0 all success, group 1 one of four
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    cfg = Config()
    cfg.grpo.baseline = "batch"
    whole = advantages(rewards, groups, cfg.grpo, DistContext())
    assert whole[:5].tolist() == pytest.approx([0.724567] * 5, abs=1e-6)  # mean 0.625, std 0.517549 (test_losses)
    cfg.grpo.baseline = "group"
    assert advantages(rewards, groups, cfg.grpo, DistContext())[:4].tolist() == [0.0] * 4
    mp.start_processes(_advantage_worker, args=(2, free_port(), rewards, groups, 4, str(tmp_path)), nprocs=2, start_method="spawn")
    seen = []
    for r in range(2):
        rows, adv = torch.load(tmp_path / f"adv{r}.pt")
        assert adv.tolist() == pytest.approx(whole[rows].tolist(), abs=1e-6)
        seen += rows
    assert sorted(seen) == list(range(8))
