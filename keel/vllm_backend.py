"""An optional GPU rollout backend on vLLM, with the same Trajectory output as `keel.rollout`.

Token-in/token-out, as in the built-in engine: prompt ids go in as `prompt_token_ids`, the
sampled ids and their log-probs come back, and each later turn is submitted as the *whole*
token list so far (prompt + sampled ids + tool-response ids), never as re-tokenised text.
vLLM's prefix cache then finds the earlier turns' KV blocks, so continuing costs roughly the
new tokens only. After every optimizer step `sync_weights(model)` copies the trainer's weights
into the engine and drops the prefix cache (its blocks were computed with the old weights).

Targets vLLM 0.22–0.31 (the range TRL 1.16 supports), `vllm.LLM` in-process
(`distributed_executor_backend="external_launcher"`, as TRL's colocate mode) with
`logprobs_mode="processed_logprobs"`, so returned log-probs are under the temperature-scaled
distribution, as Keel stores them. The subset of vLLM used: `LLM(...)`, `LLM.generate(prompts,
sampling_params, use_tqdm)`, `LLM.reset_prefix_cache()`, `SamplingParams(temperature, max_tokens,
logprobs=0, stop_token_ids, seed, skip_special_tokens)`, outputs' `.outputs[0].token_ids /
.logprobs[k][token].logprob / .finish_reason`, and the driver worker's `model.load_weights`.
Verified here only against a fake engine with that surface (vLLM is not installed; no GPU);
the log-probs vLLM returns are bf16/fp16 kernels' and differ from the trainer's fp32
recomputation (MEASURED.md: mean 0.036 for bf16), so recompute old log-probs or correct for it.

Departure from `keel.rollout`: no `steer` (forcing token sequences is a test device of the
built-in engine), and a turn's last token is checked rather than trusted: a turn that did not
end with <|im_end|> is a truncation.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from keel.chat import IM_END, render_tool_responses, render_user_turn
from keel.episode import process_turn
from keel.rollout import SamplingParams, encode_prompt
from keel.types import Env, Source, Task, Trajectory, episode_info


class VLLMBackend:
    """Rollouts with a vLLM engine. `engine` is a `vllm.LLM` (or anything with the subset above);
    `sampling_params_cls` is `vllm.SamplingParams` unless given (tests pass a stand-in)."""

    def __init__(self, engine: Any, tokenizer: Any, sampling_params_cls: Callable[..., Any] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        if sampling_params_cls is None:
            from vllm import SamplingParams as sampling_params_cls  # noqa: N813 (vLLM's class)
        self.sampling_params_cls = sampling_params_cls
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)
        if self.im_end is None or self.im_end == getattr(tokenizer, "unk_token_id", -1):
            raise ValueError(f"VLLMBackend: the tokenizer has no {IM_END} token; Keel's chat format needs it")

    @classmethod
    def from_model_dir(cls, model_dir: str, tokenizer: Any, dtype: str = "bfloat16", seed: int = 0,
                       gpu_memory_utilization: float = 0.3, max_model_len: int = 4096) -> "VLLMBackend":
        """An in-process engine on one GPU for the model saved in `model_dir` (config + weights;
        `sync_weights` replaces the weights after each update)."""
        try:
            from vllm import LLM
        except ImportError:
            raise ImportError("the vLLM rollout backend needs vLLM on a CUDA machine: pip install 'keel[vllm]'") from None
        # external_launcher keeps the engine in this process, so load_weights reaches the model;
        # it needs torch.distributed's rendezvous variables even for one process.
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
            os.environ.setdefault(key, value)
        engine = LLM(model=model_dir, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                     max_model_len=max_model_len, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                     distributed_executor_backend="external_launcher")
        return cls(engine, tokenizer)

    def sync_weights(self, model: torch.nn.Module) -> int:
        """Copy `model`'s weights into the engine; returns how many tensors were sent.

        Names are the Hugging Face state-dict names (vLLM's `load_weights` maps them, tied
        `lm_head.weight` included). The prefix cache is reset: its KV blocks came from the old weights.
        """
        runner_model = self.engine.llm_engine.model_executor.driver_worker.model_runner.model
        count = 0

        def named() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in model.state_dict().items():
                count += 1
                yield name, tensor.detach()

        with torch.no_grad():
            runner_model.load_weights(named())
        self.engine.reset_prefix_cache()
        return count

    def _sampling(self, params: SamplingParams, max_tokens: int, seed: int | None) -> Any:
        # temperature 0 is vLLM's greedy; logprobs=0 returns the sampled token's log-prob only
        return self.sampling_params_cls(
            temperature=0.0 if params.greedy else params.temperature,
            max_tokens=max_tokens,
            logprobs=0,
            stop_token_ids=[self.im_end],
            seed=seed,
            skip_special_tokens=False,
        )

    def rollout(self, env: Env, tasks: Sequence[Task], params: SamplingParams, hints: Sequence[str | None] | None = None,
                groups: Sequence[int] | None = None, seed: int | None = None) -> list[Trajectory]:
        """One episode per task, all rows' turns submitted together; same contract as `keel.rollout.rollout`.

        `seed` makes row i's turn t reproducible (vLLM per-request seed seed + 1000·i + t).
        """
        if hints is not None and len(hints) != len(tasks):
            raise ValueError(f"VLLMBackend.rollout: {len(hints)} hints for {len(tasks)} tasks")
        if groups is not None and len(groups) != len(tasks):
            raise ValueError(f"VLLMBackend.rollout: {len(groups)} group ids for {len(tasks)} tasks")
        t0 = time.perf_counter()
        rows = []
        for i, task in enumerate(tasks):
            ids, sources = encode_prompt(self.tokenizer, env, task, hints[i] if hints else None)
            traj = Trajectory(task_id=task.id, token_ids=ids, sources=[int(s) for s in sources], logprobs=[0.0] * len(ids),
                              group=groups[i] if groups else -1)
            rows.append((traj, env.start(task)))
        try:
            active = [i for i in range(len(rows)) if len(rows[i][0].token_ids) < params.max_total_tokens]
            for i in set(range(len(rows))) - set(active):
                rows[i][0].truncated = True
            turn = 0
            while active:
                requests = []
                for i in active:
                    tr = rows[i][0]
                    budget = min(params.max_new_tokens, params.max_total_tokens - len(tr.token_ids))
                    requests.append((i, {"prompt_token_ids": list(tr.token_ids)},
                                     self._sampling(params, budget, None if seed is None else seed + 1000 * i + turn)))
                outputs = self.engine.generate([r[1] for r in requests], sampling_params=[r[2] for r in requests], use_tqdm=False)
                if len(outputs) != len(requests):
                    raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
                still = []
                for (i, _, _), out in zip(requests, outputs):
                    if self._turn(rows[i][0], rows[i][1], out.outputs[0], turn, params):
                        still.append(i)
                active = still
                turn += 1
        finally:
            for tr, episode in rows:
                try:
                    episode.close()
                    tr.info.update(episode_info(episode))
                except Exception as exc:  # a failing close must not lose the batch
                    tr.info["close_error"] = f"{type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - t0
        for tr, _ in rows:
            tr.info["rollout_s"] = elapsed
        return [tr for tr, _ in rows]

    def _turn(self, tr: Trajectory, episode: Any, completion: Any, turn: int, params: SamplingParams) -> bool:
        """Append one sampled turn and, when the episode goes on, its tool responses. True = continue."""
        ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            got = "no" if completion.logprobs is None else len(completion.logprobs)
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {got} log-probs; SamplingParams needs logprobs=0")
        logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs, ids)]
        start = len(tr.token_ids)
        tr.token_ids.extend(ids)
        tr.sources.extend([int(Source.POLICY)] * len(ids))
        tr.logprobs.extend(logprobs)
        tr.turn_spans.append((start, len(tr.token_ids)))
        ended = bool(ids) and ids[-1] == self.im_end
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        tr.turn_texts.append(text)
        if not ended:  # max_tokens or the episode budget cut the turn
            tr.truncated = True
            return False
        outcome = process_turn(episode, text, turn)
        tr.steps.extend(outcome.steps)
        if outcome.answer is not None:
            tr.answer = outcome.answer
        if outcome.final:
            tr.finished = True
            return False
        if turn + 1 >= params.max_turns:
            tr.truncated = True
            return False
        suffix = render_tool_responses(outcome.results) if outcome.steps else render_user_turn(outcome.next_user or "")
        suffix_ids = self.tokenizer.encode(suffix, add_special_tokens=False)
        if len(tr.token_ids) + len(suffix_ids) + 1 > params.max_total_tokens:
            tr.truncated = True
            return False
        tr.token_ids.extend(suffix_ids)
        tr.sources.extend([int(Source.TOOL)] * len(suffix_ids))
        tr.logprobs.extend([0.0] * len(suffix_ids))
        return True
