"""The GRPO update on real (steered) rollouts: micro-batching does not change it, it moves the
policy towards high-advantage samples, and a NaN skips the step instead of poisoning weights."""

import copy

import torch

from fakes import EchoEnv, make_tasks
from keel.config import Config
from keel.losses import group_advantages
from keel.rollout import SamplingParams, rollout
from keel.train import grpo_update


def _batch(tiny):
    model, tok = tiny
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)

    def steer(row, turn):
        return call if turn == 0 and row % 2 == 0 else None

    tasks = [t for t in make_tasks(2) for _ in range(4)]
    trajs = rollout(model, tok, EchoEnv(), tasks, SamplingParams(max_turns=2, max_new_tokens=24), generator=torch.Generator().manual_seed(1), steer=steer, groups=[0] * 4 + [1] * 4)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    return trajs, group_advantages(rewards, torch.tensor([0] * 4 + [1] * 4))


def _grads_after(model, trajs, adv, cfg, pad):
    m = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # lr 0: keep weights, inspect gradients
    stats = grpo_update(m, ref, opt, trajs, adv, cfg.grpo, pad, 1.0, max_tokens=cfg.model.max_tokens_per_micro_batch,
                        keep_prefix_graph=not cfg.model.recompute_shared_prefix)
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, stats


def test_micro_batch_size_does_not_change_gradients(tiny, monkeypatch):
    """Rows alone, all 8 in one micro-batch, or cut by a token cap (the update's shared prefix then
    kept over the micro-batches with its graph, or encoded again in backward under
    `model.recompute_shared_prefix`): the same gradients."""
    import keel.train

    kept = []  # per update_prefix call: whether the prefix's graph is kept
    real = keel.train.update_prefix

    def spy(*args, **kwargs):
        prefix = real(*args, **kwargs)
        kept.append(prefix is not None and bool(prefix._sources))
        return prefix

    monkeypatch.setattr(keel.train, "update_prefix", spy)
    model, tok = tiny
    trajs, adv = _batch(tiny)
    for agg in ("token-mean", "seq-mean-token-mean"):
        cfg_a, cfg_b = Config(), Config()
        cfg_a.grpo.loss_aggregation = cfg_b.grpo.loss_aggregation = agg
        cfg_a.grpo.micro_batch_size, cfg_b.grpo.micro_batch_size = 8, 1
        cfg_a.model.max_tokens_per_micro_batch = 0
        cfg_c = copy.deepcopy(cfg_a)  # 8 rows allowed, cut by a token cap into uneven micro-batches
        from keel.logprobs import micro_batches

        seqs = [t.token_ids for t in trajs]
        cap = next(c for c in range(1, 10**6) if len(micro_batches(seqs, 8, c)) <= 3)  # smallest cap giving ≤ 3 micro-batches
        cfg_c.model.max_tokens_per_micro_batch = cap
        assert 1 < len(micro_batches(seqs, 8, cap)) < len(trajs)
        cfg_a.grpo.max_grad_norm = cfg_b.grpo.max_grad_norm = cfg_c.grpo.max_grad_norm = 1e9
        cfg_d = copy.deepcopy(cfg_c)
        cfg_d.model.recompute_shared_prefix = True
        ga, sa = _grads_after(model, trajs, adv, cfg_a, tok.pad_token_id)
        for cfg in (cfg_b, cfg_c, cfg_d):
            kept.clear()
            gb, sb = _grads_after(model, trajs, adv, cfg, tok.pad_token_id)
            # the policy's prefix (the first call; the reference's is kept without a graph): its graph
            # kept where no cap or the cap counted it, not when recomputing
            assert kept[0] == (cfg is not cfg_d), kept
            assert ga.keys() == gb.keys() and ga
            for k in ga:
                assert torch.allclose(ga[k], gb[k], atol=1e-6, rtol=1e-4), (agg, k)
            assert abs(sa["loss/policy"] - sb["loss/policy"]) < 1e-6


def test_reference_prefix_shared_across_micro_batches(tiny):
    """With a reference that differs from the policy and a large KL weight, an update cut into
    micro-batches (policy and reference each encode the shared prefix once for all of them) gives
    the KL statistics and gradients of one uncut micro-batch."""
    from keel.logprobs import micro_batches

    model, tok = tiny
    trajs, adv = _batch(tiny)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for q in ref.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=gen))
    seqs = [t.token_ids for t in trajs]
    cap = next(c for c in range(1, 10**6) if len(micro_batches(seqs, 8, c)) <= 3)
    assert len(micro_batches(seqs, 8, cap)) > 1
    results = []
    for tokens in (0, cap):
        cfg = Config()
        cfg.grpo.kl_coef, cfg.grpo.max_grad_norm = 1.0, 1e9
        cfg.model.max_tokens_per_micro_batch = tokens
        m = copy.deepcopy(model)
        stats = grpo_update(m, ref, torch.optim.SGD(m.parameters(), lr=0.0), trajs, adv, cfg.grpo, tok.pad_token_id, 1.0,
                            max_tokens=cfg.model.max_tokens_per_micro_batch)
        results.append((stats, {n: q.grad.clone() for n, q in m.named_parameters() if q.grad is not None}))
    (sa, ga), (sb, gb) = results
    assert sa["kl/k1_mean"] > 1e-3  # the reference really differs
    for key in ("kl/k1_mean", "kl/k3_mean", "loss/kl", "loss/total"):
        assert abs(sa[key] - sb[key]) < 1e-5, (key, sa[key], sb[key])
    for k in ga:
        assert torch.allclose(ga[k], gb[k], atol=1e-6, rtol=1e-4), k


def test_update_increases_the_advantage_weighted_likelihood(tiny):
    """At ratio 1 the surrogate's gradient is that of J = Σ_tokens A·logp / N; a small step must raise J."""
    from keel.logprobs import collate, token_logprobs

    model, tok = tiny
    trajs, adv = _batch(tiny)
    m = copy.deepcopy(model)
    cfg = Config()
    cfg.grpo.kl_coef = 0.0

    def objective():
        b = collate(trajs, advantages=adv.tolist())
        with torch.no_grad():
            lp, _ = token_logprobs(m, b.input_ids, b.attention_mask, b.target_mask)
        return (lp * b.advantages[b.target_mask]).sum().item()

    before = objective()
    stats = grpo_update(m, None, torch.optim.SGD(m.parameters(), lr=1e-3), trajs, adv, cfg.grpo, tok.pad_token_id, 1.0)
    assert stats["loss/trained_members"] == 8.0 and stats["loss/skipped_nonfinite"] == 0.0
    assert objective() > before


def test_nonfinite_loss_skips_the_update(tiny):
    model, tok = tiny
    trajs, adv = _batch(tiny)
    m = copy.deepcopy(model)
    before = {n: p.clone() for n, p in m.named_parameters()}
    adv = adv.clone()
    adv[0] = float("nan")
    cfg = Config()
    stats = grpo_update(m, copy.deepcopy(model), torch.optim.AdamW(m.parameters(), lr=1e-2), trajs, adv, cfg.grpo, tok.pad_token_id, 1.0)
    assert stats["loss/skipped_nonfinite"] == 1.0
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n])


def test_uniform_groups_are_skipped(tiny):
    model, tok = tiny
    trajs, _ = _batch(tiny)
    adv = torch.zeros(8)
    stats = grpo_update(copy.deepcopy(model), None, torch.optim.SGD(model.parameters(), lr=0.1), trajs, adv, Config().grpo, tok.pad_token_id, 1.0)
    assert stats["loss/trained_members"] == 0.0 and stats["loss/total"] == 0.0
