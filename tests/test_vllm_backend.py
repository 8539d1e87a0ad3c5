"""The vLLM rollout backend against a fake engine with the subset of vLLM's API it uses.

The fake decodes with the tiny model (no cache, a full forward per token), applies the same
temperature vLLM's `processed_logprobs` mode applies, and records every request, so these
tests check the backend's side of the contract: prompts are the exact token lists so far
(token-in), stored ids and log-probs are what the engine returned (token-out) and equal a
plain forward over the stored trajectory, sampling parameters, truncation and weight sync.
What they cannot check: vLLM itself (not installed here, no GPU).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from fakes import EchoEnv, make_tasks
from keel.logprobs import collate, token_logprobs
from keel.rollout import SamplingParams, rollout
from keel.types import Source
from keel.vllm_backend import VLLMBackend


@dataclass
class FakeSamplingParams:
    """vLLM's SamplingParams fields the backend sets."""

    temperature: float
    max_tokens: int
    logprobs: int | None
    stop_token_ids: list[int]
    seed: int | None
    skip_special_tokens: bool


class FakeRunnerModel:
    """Stands in for the driver worker's model: `load_weights(iterable of (name, tensor))`."""

    def __init__(self, model):
        self.model = model
        self.loaded: list[str] = []

    def load_weights(self, weights):
        state = self.model.state_dict()
        for name, tensor in weights:
            self.loaded.append(name)
            state[name].copy_(tensor)


class FakeLLM:
    """`generate(prompts, sampling_params, use_tqdm)` and `reset_prefix_cache()` over an HF model.
    `force(prompt_ids) -> ids | None` scripts a turn (its log-probs are still the model's)."""

    def __init__(self, model, force=None, drop_logprobs=False, extra_output=False):
        self.model = copy.deepcopy(model).eval()
        self.force = force
        self.drop_logprobs = drop_logprobs
        self.extra_output = extra_output
        self.requests: list[tuple[list[int], FakeSamplingParams]] = []
        self.resets = 0
        runner = SimpleNamespace(model=FakeRunnerModel(self.model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))

    def reset_prefix_cache(self):
        self.resets += 1

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=True):
        outs = []
        for prompt, sp in zip(prompts, sampling_params):
            ids = list(prompt["prompt_token_ids"])
            self.requests.append((ids, sp))
            forced = self.force(ids) if self.force else None
            gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
            out, lps = [], []
            for k in range(sp.max_tokens):
                logits = self.model(input_ids=torch.tensor([ids + out]), logits_to_keep=1).logits[0, -1].float()
                logp = torch.log_softmax(logits / (sp.temperature if sp.temperature > 0 else 1.0), -1)
                if forced is not None and k < len(forced):
                    t = forced[k]
                elif sp.temperature == 0:
                    t = int(logp.argmax())
                else:
                    t = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(t)
                lps.append({t: SimpleNamespace(logprob=float(logp[t]), rank=1)})
                if t in sp.stop_token_ids:
                    break
            finish = "stop" if out and out[-1] in sp.stop_token_ids else "length"
            outs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[SimpleNamespace(token_ids=out, logprobs=None if self.drop_logprobs else lps, finish_reason=finish)]))
        return outs + (outs[:1] if self.extra_output else [])


def _force(tok):
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"x": "a"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    answer = tok.encode("<answer>item1</answer><|im_end|>", add_special_tokens=False)

    def force(prompt_ids):
        # task i makes i % 3 calls, then answers (i % 4 == 3: samples its last turn freely)
        text = tok.decode(prompt_ids)
        i = int(text.split("What is item ")[1].split("?")[0])
        done = text.count("<tool_response>")
        if done < i % 3:
            return call
        return None if i % 4 == 3 else answer

    return force


def test_multi_turn_trajectories_are_token_in_token_out(tiny):
    model, tok = tiny
    engine = FakeLLM(model, force=_force(tok))
    backend = VLLMBackend(engine, tok, FakeSamplingParams)
    env = EchoEnv(lengths=(1, 7, 3, 12))
    trajs = backend.rollout(env, make_tasks(6), SamplingParams(temperature=0.7, max_turns=4, max_new_tokens=40), groups=[0, 0, 0, 1, 1, 1], seed=3)
    # ragged: tasks 0..5 make 0,1,2,0,1,2 calls → 1,2,3,1,2,3 turns; task 3 samples its answer turn
    assert [len(t.turn_spans) for t in trajs] == [1, 2, 3, 1, 2, 3]
    assert [len(t.steps) for t in trajs] == [0, 1, 2, 0, 1, 2]
    assert [t.group for t in trajs] == [0, 0, 0, 1, 1, 1]
    assert all(ep.closed for ep in env.episodes)
    assert trajs[2].finished and trajs[2].answer == "item1" and trajs[3].truncated
    # token-in: every request was the trajectory's exact prefix up to a turn start
    for ids, _ in engine.requests:
        tr = next(t for t in trajs if t.token_ids[: len(ids)] == ids)
        assert len(ids) in [a for a, _ in tr.turn_spans]
    assert len(engine.requests) == sum(len(t.turn_spans) for t in trajs)  # 12 requests, 3 generate calls
    # token-out: a plain forward over the stored ids reproduces the stored log-probs
    batch = collate(trajs)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask, temperature=0.7)
    old = batch.old_logprobs[batch.target_mask]
    assert lp.numel() > 100 and (lp - old).abs().max().item() <= 1e-4
    # tool text is spliced as Source.TOOL between turns, ending in a new assistant header
    tr = trajs[2]
    (a0, e0), (a1, _) = tr.turn_spans[:2]
    assert set(tr.sources[e0:a1]) == {Source.TOOL}
    assert tok.decode(tr.token_ids[e0:a1]).endswith("<|im_start|>assistant\n")


def test_greedy_equals_the_builtin_engine(tiny):
    """Two implementations, one contract: greedy ids and log-probs equal keel.rollout's."""
    model, tok = tiny
    params = SamplingParams(greedy=True, max_turns=1, max_new_tokens=12)
    tasks = make_tasks(3)
    ours = rollout(model, tok, EchoEnv(), tasks, params)
    theirs = VLLMBackend(FakeLLM(model), tok, FakeSamplingParams).rollout(EchoEnv(), tasks, params)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids and a.sources == b.sources and a.turn_spans == b.turn_spans
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
        assert a.truncated and b.truncated  # the random model never closes its turn in 12 tokens


def test_sampling_params_and_token_budget(tiny):
    model, tok = tiny
    engine = FakeLLM(model, force=_force(tok))
    backend = VLLMBackend(engine, tok, FakeSamplingParams)
    trajs = backend.rollout(EchoEnv(), make_tasks(2)[1:], SamplingParams(temperature=0.5, max_turns=4, max_new_tokens=40, max_total_tokens=10_000), seed=7)
    ids, sp = engine.requests[0]
    prompt_len = len(ids)
    assert (sp.temperature, sp.max_tokens, sp.logprobs, sp.skip_special_tokens) == (0.5, 40, 0, False)
    assert sp.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    # row 0 (task "1"), turn 0 → seed 7 + 1000·0 + 0; turn 1 → 8
    assert [s.seed for _, s in engine.requests] == [7, 8] and len(trajs[0].turn_spans) == 2
    # a tight episode budget caps max_tokens at what is left: prompt + 5 tokens
    engine.requests.clear()
    tight = backend.rollout(EchoEnv(), make_tasks(1), SamplingParams(max_turns=4, max_new_tokens=40, max_total_tokens=prompt_len + 5))
    assert engine.requests[0][1].max_tokens == 5 and tight[0].truncated
    assert len(tight[0].token_ids) == prompt_len + 5
    # greedy is vLLM's temperature 0
    engine.requests.clear()
    backend.rollout(EchoEnv(), make_tasks(1), SamplingParams(greedy=True, max_turns=1, max_new_tokens=3))
    assert engine.requests[0][1].temperature == 0.0


def test_sync_weights_copies_every_tensor_and_resets_the_prefix_cache(tiny):
    model, tok = tiny
    engine = FakeLLM(model)
    backend = VLLMBackend(engine, tok, FakeSamplingParams)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05)
    task = make_tasks(1)
    params = SamplingParams(greedy=True, max_turns=1, max_new_tokens=6)
    before = backend.rollout(EchoEnv(), task, params)[0].logprobs
    n = backend.sync_weights(trained)
    assert n == len(trained.state_dict()) and engine.resets == 1
    assert sorted(engine.llm_engine.model_executor.driver_worker.model_runner.model.loaded) == sorted(trained.state_dict())
    for k, v in trained.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], v), k
    after = backend.rollout(EchoEnv(), task, params)[0]
    assert after.logprobs != before  # the engine now samples from the trained weights
    batch = collate([after])
    with torch.no_grad():
        lp, _ = token_logprobs(trained, batch.input_ids, batch.attention_mask, batch.target_mask)
    assert (lp - batch.old_logprobs[batch.target_mask]).abs().max().item() <= 1e-4


def test_bad_inputs_and_engine_replies(tiny):
    model, tok = tiny
    backend = VLLMBackend(FakeLLM(model), tok, FakeSamplingParams)
    params = SamplingParams(max_turns=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="2 hints for 1 tasks"):
        backend.rollout(EchoEnv(), make_tasks(1), params, hints=[None, None])
    with pytest.raises(ValueError, match="3 group ids for 1 tasks"):
        backend.rollout(EchoEnv(), make_tasks(1), params, groups=[0, 1, 2])
    with pytest.raises(RuntimeError, match="needs logprobs=0"):
        VLLMBackend(FakeLLM(model, drop_logprobs=True), tok, FakeSamplingParams).rollout(EchoEnv(), make_tasks(1), params)
    env = EchoEnv()
    with pytest.raises(RuntimeError, match="2 outputs for 1 prompts"):
        VLLMBackend(FakeLLM(model, extra_output=True), tok, FakeSamplingParams).rollout(env, make_tasks(1), params)
    assert all(ep.closed for ep in env.episodes)  # episodes are closed even when the engine misbehaves
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'keel\[vllm\]'"):
            VLLMBackend.from_model_dir("/nonexistent", tok)
        with pytest.raises(ImportError):
            VLLMBackend(FakeLLM(model), tok)  # no stand-in and no vLLM: the import fails loudly
