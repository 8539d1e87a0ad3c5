"""Batched, KV-cached, multi-turn rollouts on a transformers causal LM. Token-in/token-out.

All episodes of a batch advance together. Within an assistant turn every row decodes one
token per forward pass; a row whose turn has ended feeds a masked hole instead. When every
row's turn has ended, each row's calls are executed and its tool-response tokens are appended
to the *same* KV cache in one forward pass (ragged lengths become masked holes), so history is
never re-encoded. Position ids are explicit: a row's positions count only its real tokens, so
holes change nothing but wasted compute.

The ids a row sampled are the ids stored; the text of a turn is only decoded to parse calls.
Each stored policy token carries the log-prob it was sampled with (temperature-scaled
distribution); `tests/test_rollout.py` checks that one plain forward pass over the stored ids
reproduces them (max abs diff ≤ 1e-4, fp32).

Why prompts are not simply left-padded: the first pad positions of a left-padded prefill have
no visible key; SDPA then produces NaN hidden states that leak through the cache (0 weight ×
NaN value = NaN). Keel encodes the prompts' shared prefix once (the system block, most of a
prompt) and appends the ragged remainders as a block whose holes can see that prefix; with
no shared prefix it prefills each distinct prompt alone and zero-pads the cache. On CPU the
shared prefix's keys and values are kept once per layer and attended to by all rows at once
(keel.cascade), so a decode step reads them once instead of once per row: at batch 64 with
~620-token prompts that made sampling 1.4–1.7× faster (bench/sampler_vs_generate.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from keel import cascade, native
from keel.chat import IM_END, IM_START, TOOLS_POSTAMBLE, TOOLS_PREAMBLE, render_tool_responses, render_user_turn
from keel.decode import LeanDecoder
from keel.episode import process_turn
from keel.logprobs import common_prefix_len
from keel.memory import decoding_heap
from keel.templates import ChatTemplate, Conversation
from keel.types import Env, Source, Task, Trajectory, episode_info

import json


@dataclass
class SamplingParams:
    temperature: float = 1.0
    greedy: bool = False
    max_turns: int = 4  # assistant turns per episode
    max_new_tokens: int = 128  # per assistant turn
    max_total_tokens: int = 2048  # whole episode, prompt included
    # A turn cut at max_new_tokens: "stop" ends the episode as truncated (training's rule: a cut
    # turn is not a turn the model finished); "continue" closes the turn with the end-of-turn
    # token and processes its text like any other turn, as benchmark harnesses treat a model's
    # output (bfcl-eval parses whatever came back). Evaluation only; Hermes layout only.
    on_cut: str = "stop"


HINT_POSITIONS = ("system", "user")


def encode_prompt(tokenizer, env: Env, task: Task, hint: str | None = None, position: str = "system") -> tuple[list[int], list[int]]:
    """(ids, sources) of system + first user message + assistant header.

    Encoded in parts so that a hint can be cut out exactly: A (system header and instructions),
    B (tools listing, user header and message), C (<|im_end|> and the assistant header). A hint
    (Source.HINT) goes after A ("system": it closes the instructions, as in paper A's code) or
    after B ("user": appended to the question). Dropping the hint leaves A + B + C, the very
    ids of the hint-free prompt, which is what the loss sees. Parts B and C meet at a special
    token, so encoding them apart gives the same ids as encoding them together.
    """
    if position not in HINT_POSITIONS:
        raise ValueError(f"signals.hint.position: {position!r} is not one of {HINT_POSITIONS}")
    tools = env.tools(task)
    part_b = ""
    if tools:
        part_b = "\n\n" + TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_POSTAMBLE
    part_b += f"{IM_END}\n{IM_START}user\n{env.user_message(task)}"
    parts = [(f"{IM_START}system\n{env.system_prompt(task)}", Source.PROMPT), (part_b, Source.PROMPT)]
    if hint:
        parts.insert(1 if position == "system" else 2, ("\n\n" + hint, Source.HINT))
    parts.append((f"{IM_END}\n{IM_START}assistant\n", Source.PROMPT))
    ids: list[int] = []
    sources: list[int] = []
    for text, source in parts:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        sources += [int(source)] * len(piece)
    return ids, sources


@dataclass
class _Row:
    task: Task
    episode: object
    ids: list[int]
    sources: list[int]
    logprobs: list[float]
    traj: Trajectory
    active: bool = True
    turn: int = 0
    turn_start: int = 0
    forced: list[int] | None = None
    n_valid: int = 0  # real tokens of this row already in the KV cache
    pending: list[int] = field(default_factory=list)  # sampled ids not yet fed to the cache
    conversation: Conversation | None = None  # the episode as the model's chat template renders it (`chat`)


def _growing_cache():
    """A transformers DynamicCache whose layers append in place (see `_GrowingLayer`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layer_class_to_replicate=_growing_layer_class())
    return cache


@functools.cache
def _growing_layer_class():
    """`DynamicLayer` appends with torch.cat: every decode step copies the whole cache (at batch
    16 and 1,300 tokens of history, ~1 GB per step for SmolLM2's 30 layers, which is what made
    8-turn decoding 2.9× slower per token than 1-turn). This layer keeps keys and values in
    buffers with spare capacity (grown ×1.5 when full: a ×2 buffer after a regrowth holds up to
    twice the cache, ~1 GB of slack at eval batch 50) and exposes the filled part as a view, so a
    step writes only its new column. Any method of the base class that replaces `keys`/`values`
    (batch_repeat_interleave, reorder_cache, ...) is honoured: the next update adopts the new
    tensors into fresh buffers."""
    from transformers.cache_utils import DynamicLayer

    class _GrowingLayer(DynamicLayer):
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # shared prefix K/V [1, kv, P, D] (keel.cascade)
        _kbuf: torch.Tensor | None = None  # key and value buffers [B, kv, capacity, D]; keys/values: their first columns
        _vbuf: torch.Tensor | None = None

        def columns(self, new: int, free: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
            """(key buffer, value buffer, n): `update` without the copy, for a caller that writes
            the `new` columns n..n+new of the buffers itself (keel.decode's native step). keys
            and values now cover n + new columns. None where the buffers are not this layer's
            keys and values (not yet made, or replaced) or are full: call `update` instead.
            `free`: what `free_columns(new)` just returned for this layer, not asked again."""
            got = self.free_columns(new) if free is None else free
            if got is not None:
                n = got[2]
                self.keys = got[0][:, :, : n + new]
                self.values = got[1][:, :, : n + new]
            return got

        def free_columns(self, new: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
            """What `columns(new)` would return, the columns not taken (keys and values unchanged)."""
            buf, keys = self._kbuf, self.keys
            if buf is None or keys.data_ptr() != buf.data_ptr() or keys.shape[:2] != buf.shape[:2]:
                return None
            n = keys.shape[-2]
            if n + new > buf.shape[-2]:
                return None
            return buf, self._vbuf, n

        def get_seq_length(self) -> int:
            return super().get_seq_length() + (self.prefix[0].shape[-2] if self.prefix is not None else 0)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys = self.keys
            buf = self._kbuf
            n = keys.shape[-2] if keys.numel() else 0
            adopted = buf is not None and keys.data_ptr() == buf.data_ptr() and keys.shape[:2] == buf.shape[:2]
            new = key_states.shape[-2]
            if not adopted or n + new > buf.shape[-2]:
                cap = max((3 * (n + new)) // 2, 256)
                shape = (*key_states.shape[:2], cap, key_states.shape[-1])
                kbuf = key_states.new_empty(shape)
                vbuf = value_states.new_empty(shape[:3] + (value_states.shape[-1],))
                if n:
                    kbuf[:, :, :n] = keys
                    vbuf[:, :, :n] = self.values
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, n : n + new] = key_states
            self._vbuf[:, :, n : n + new] = value_states
            self.keys = self._kbuf[:, :, : n + new]
            self.values = self._vbuf[:, :, : n + new]
            return self.keys, self.values

    return _GrowingLayer


def _cascading(model) -> bool:
    """Whether the model runs keel.cascade's attention now (inside `_cascade_attention`)."""
    return model.config._attn_implementation == cascade.NAME


def _last_column(input_ids: torch.Tensor) -> torch.Tensor:
    """`logits_to_keep` for "the last column only", as an index tensor rather than the int 1.

    Only the last column's logits are used (a 60-token tool block at batch 16 would otherwise
    materialise 16×60×49k logits). With the int, transformers slices the hidden states to a
    strided [B, 1, H] view, and torch 2.13's CPU bf16 linear on that view broadcasts the LM head
    to every row: at batch 50, 1.8 s and 2.7 GB for what takes 5.5 ms on a contiguous input
    (bench/lm_head_view.py). An index tensor makes the slice a contiguous copy."""
    return torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)


def _forward(model, input_ids, attn, positions, cache):
    # keel_cache: read by keel.cascade's attention
    extra = {"keel_cache": cache} if _cascading(model) else {}
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=_last_column(input_ids), **extra)
    return out.logits[:, -1, :].float(), out.past_key_values


def _block(model, decoder: LeanDecoder | None, input_ids, attn, positions, cache):
    """(last column's logits [B, V] fp32, cache) of a block of new tokens per row appended to the
    cache: through `decoder.block` where there is a decoder, else the model's forward."""
    if decoder is not None:
        return decoder.block(input_ids, attn, positions, cache), cache
    return _forward(model, input_ids, attn, positions, cache)


@contextlib.contextmanager
def _cascade_attention(model, enabled: bool):
    """Run the model with keel.cascade's attention (shared prefix stored and read once) inside."""
    if not enabled or not cascade.available():
        yield
        return
    with cascade.in_place_of_sdpa(model.config, cascade.NAME, cascade.attention):  # eager/flash are left as they are
        yield


def _prefill(model, prompts: list[list[int]], device, decoder: LeanDecoder | None = None) -> tuple[torch.Tensor, object, torch.Tensor]:
    """Encode the prompts into one batched KV cache (the remainders' block through `decoder.block`
    when given, else the model's forward).

    Returns (last logits [B, V], cache, attention mask [B, L]). Prompts of one run share a long
    prefix (system block with the tool schemas, ~600 tokens for the KG env): it is encoded once
    and, when keel.cascade's attention is active, kept once in every layer; otherwise
    the cache is repeated over the batch. The ragged remainders (the questions) then go in as
    one right-aligned block, each distinct one once (a GRPO batch asks each question group_size
    times; at 8 × 4 on the KG task, bf16: 0.46 instead of 0.97 s, LOG.md, twenty-seventh
    session), and their keys and values are repeated to the rows that ask it. Without a shared
    prefix, or when the remainders are longer than it and the distinct prompts hold no more
    tokens than the padded block (long prompts sharing little: BFCL tasks of different API
    classes share a ~200-token start), each distinct prompt is encoded alone: the block's padding
    mask rules out the causal attention kernel, and its attention over thousands of columns is
    then materialised (5 BFCL prompts of 3–4.7k tokens:
    83 s as one block, 33 s one by one, fp32; LOG.md, twenty-fourth session).
    """
    B = len(prompts)
    first = prompts[0]
    lcp = common_prefix_len(prompts)
    width = max(len(p) for p in prompts) - lcp
    # a GRPO batch holds each prompt group_size times: its remainder is encoded once, then repeated
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(p[lcp:]), len(distinct)) for p in prompts]
    D = len(distinct)
    if lcp == 0 or (width > lcp and sum(lcp + len(r) for r in distinct) <= lcp + D * width):
        return _prefill_each(model, prompts, device)
    ids = torch.tensor([first[:lcp]], device=device)
    out = model(input_ids=ids, past_key_values=_growing_cache(), use_cache=True, logits_to_keep=_last_column(ids))
    cache = out.past_key_values
    if _cascading(model):
        prefix, cache = cache, _growing_cache()
        for layer in prefix.layers:
            cache.layers.append(_growing_layer_class()())
            cache.layers[-1].prefix = (layer.keys, layer.values)
    else:
        cache.batch_repeat_interleave(D)
    feed = torch.zeros(D, width, dtype=torch.long, device=device)
    block = torch.zeros(D, width, dtype=torch.long, device=device)
    positions = torch.zeros(D, width, dtype=torch.long, device=device)
    for i, r in enumerate(distinct):
        # left holes can see the shared prefix, so no query is fully masked (no NaN)
        feed[i, width - len(r) :] = torch.tensor(r, device=device)
        block[i, width - len(r) :] = 1
        positions[i, width - len(r) :] = torch.arange(lcp, lcp + len(r), device=device)
    attn = torch.cat([torch.ones(D, lcp, dtype=torch.long, device=device), block], dim=1)
    logits, cache = _block(model, decoder, feed, attn, positions, cache)
    if D < B:
        index = torch.tensor(rows, device=device)
        for layer in cache.layers:
            _replace_kv(layer, layer.keys.index_select(0, index), layer.values.index_select(0, index))
        logits, attn = logits.index_select(0, index), attn.index_select(0, index)
    return logits, cache, attn


def _prefill_each(model, prompts: list[list[int]], device) -> tuple[torch.Tensor, object, torch.Tensor]:
    """Prefill each distinct prompt alone and merge into one left-zero-padded batched cache."""
    distinct: dict[tuple[int, ...], int] = {}
    for p in prompts:
        distinct.setdefault(tuple(p), len(distinct))
    per_prompt = []
    for p in distinct:
        ids = torch.tensor([list(p)], device=device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=_last_column(ids))
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        per_prompt.append((out.logits[:, -1, :].float(), kv, len(p)))
    max_len = max(n for _, _, n in per_prompt)
    rows = [distinct[tuple(p)] for p in prompts]
    cache = _growing_cache()
    num_layers = len(per_prompt[0][1])
    for layer in range(num_layers):
        ks, vs = [], []
        for r in rows:
            k, v = per_prompt[r][1][layer]
            pad = max_len - per_prompt[r][2]
            if pad:
                k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                v = torch.nn.functional.pad(v, (0, 0, pad, 0))
            ks.append(k)
            vs.append(v)
        cache.update(torch.cat(ks), torch.cat(vs), layer)
    attn = torch.zeros(len(prompts), max_len, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        attn[i, max_len - per_prompt[r][2] :] = 1
    logits = torch.cat([per_prompt[r][0] for r in rows])
    return logits, cache, attn


def _replace_kv(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A growing cache layer's keys and values replaced by new tensors (rows kept, repeated or
    compacted). Its old buffers (spare capacity included) are let go now: they would otherwise stay
    alive beside the new tensors until the layer's next update adopts those into fresh buffers."""
    layer.keys, layer.values = keys, values
    layer._kbuf = layer._vbuf = None


def _compact(cache, attn: torch.Tensor, keep: list[int], prefix_cols: int) -> tuple[object, torch.Tensor]:
    """Keep only the batch rows `keep` and drop the cache columns no kept row attends to.

    A row's cached keys are its real tokens plus masked holes: columns where other rows decoded
    while it waited, and the left padding of ragged tool blocks (~30–40% of the columns after a
    few turns at batch 16). Every later decode step would read them; instead each kept row's
    real columns are gathered to the right end (left-padded with copies of a real column, which
    are finite and masked). Keys already carry their rotary positions, so nothing else changes.
    The first `prefix_cols` columns of `attn` are the shared prefix (keel.cascade), not in the
    rows' cache. Returns (cache, new attention mask).
    """
    rows_mask = attn[keep, prefix_cols:].bool()
    counts = rows_mask.sum(-1)
    width = int(counts.max())
    if len(keep) == attn.shape[0] and width == rows_mask.shape[1]:
        return cache, attn  # nothing to drop
    device = attn.device
    index = torch.zeros(len(keep), width, dtype=torch.long, device=device)
    new_mask = torch.zeros(len(keep), width, dtype=attn.dtype, device=device)
    for b in range(len(keep)):
        cols = rows_mask[b].nonzero()[:, 0]
        n = cols.numel()
        index[b, width - n :] = cols
        index[b, : width - n] = cols[0]
        new_mask[b, width - n :] = 1
    rows = torch.tensor(keep, device=device)
    for layer in cache.layers:
        k, v = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        _replace_kv(layer, k.gather(2, index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])),
                    v.gather(2, index[:, None, :, None].expand(-1, v.shape[1], -1, v.shape[3])))
        del k, v
    prefix = attn[keep, :prefix_cols]
    return cache, torch.cat([prefix, new_mask], dim=1)


def _uniforms(n: int, generator, active: Sequence[bool] | None, device) -> torch.Tensor:
    """[n, 1] uniforms: from one generator for the batch, or one draw from each active row's own
    generator (inactive rows draw nothing, so a row's samples do not depend on its batch)."""
    if not isinstance(generator, (list, tuple)):
        return torch.rand(n, 1, generator=generator, device=device)
    if len(generator) != n:
        raise ValueError(f"rollout: {len(generator)} generators for {n} rows")
    u = torch.zeros(n, 1)
    for i, g in enumerate(generator):
        if active is None or active[i]:
            u[i, 0] = torch.rand(1, generator=g)
    return u.to(device)


def _choose(logits: torch.Tensor, params: SamplingParams, generator, active: Sequence[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF (cheaper than multinomial over 49k entries).

    logits: [B, V] fp32 → (tokens [B], log-probs [B] under the temperature-scaled distribution).
    `generator`: one torch.Generator, or a list with one per row (see `_uniforms`).
    `active`: False for rows whose turn has ended (their samples are ignored): they draw nothing
    from per-row generators, and the kernel skips them (token 0, log-prob 0).
    On CPU one call of keel/decode_ops.c's `keel_sample` does the same (keel.native), ~2 ms a
    step less at batch 16 over SmolLM2's 49k tokens than these six ops.
    """
    lib = native.ops() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is not None:
        logits = logits.contiguous()
        B, V = logits.shape
        u = torch.zeros(B) if params.greedy else _uniforms(B, generator, active, logits.device)[:, 0].contiguous()
        tok, logp = torch.empty(B, dtype=torch.long), torch.empty(B)
        rows = None if active is None or all(active) else torch.tensor(active, dtype=torch.int8)  # inactive rows: not sampled
        lib.keel_sample(logits.data_ptr(), B, V, 0.0 if params.greedy else float(params.temperature), u.data_ptr(),
                        None if rows is None else rows.data_ptr(), tok.data_ptr(), logp.data_ptr())
        return tok, logp
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None])[:, 0]
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    cdf = torch.cumsum(logp.exp(), dim=-1)
    u = _uniforms(logits.shape[0], generator, active, logits.device) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u)[:, 0].clamp_(max=logits.shape[1] - 1)
    return tok, logp.gather(1, tok[:, None])[:, 0]


@torch.no_grad()
@decoding_heap()  # a fixed low mmap threshold (run.malloc_mmap_threshold_mb) is for training, not decode steps
def rollout(
    model,
    tokenizer,
    env: Env,
    tasks: Sequence[Task],
    params: SamplingParams,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    hints: Sequence[str | None] | None = None,
    steer: Callable[[int, int], list[int] | None] | None = None,
    groups: Sequence[int] | None = None,
    hint_position: str = "system",
    lean: bool = True,
    chat: ChatTemplate | None = None,
    turn_limits: Sequence[int] | None = None,
) -> list[Trajectory]:
    """Run one episode per task (repeat a task for a group) and return their trajectories.

    `steer(row, turn) -> ids | None` forces the given ids for that turn (tests use it to make a
    random model emit valid calls); the stored log-probs are still the model's for those ids.
    `generator`: one for the whole batch, or one per row; with one per row a row's samples depend
    only on its generator and the weights, not on which other rows share its batch (data-parallel
    ranks then sample what one process would, up to floating-point ties).
    `lean`: decode steps, tool-response blocks and the prompts' remainders after the shared prefix
    run `keel.decode.LeanDecoder` (the same function as the model's forward, with fewer and larger
    ops) when the model's layout allows; False: transformers' forward.
    `chat`: render with the model's own chat template (keel.templates) instead of Keel's Hermes
    ChatML: its prompt, its family's end-of-turn token and call parser, its deltas after each turn.
    Hints are Hermes-only (their removable layout is `encode_prompt`'s).
    `turn_limits`: each row's own limit on assistant turns (default params.max_turns for all).
    """
    if isinstance(generator, (list, tuple)) and len(generator) != len(tasks):
        raise ValueError(f"rollout: {len(generator)} generators for {len(tasks)} rows")
    if chat is not None and hints and any(hints):
        raise ValueError("rollout: hints need Keel's Hermes format (encode_prompt's layout); not available with a chat template")
    if params.on_cut not in ("stop", "continue"):
        raise ValueError(f"rollout: on_cut must be 'stop' or 'continue', not {params.on_cut!r}")
    if chat is not None and params.on_cut == "continue":
        raise ValueError("rollout: on_cut='continue' needs Keel's Hermes format (its end-of-turn token closes a cut turn)")
    if turn_limits is not None and len(turn_limits) != len(tasks):
        raise ValueError(f"rollout: {len(turn_limits)} turn limits for {len(tasks)} rows")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    eos = chat.end_id if chat is not None else tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows: list[_Row] = []
    for i, task in enumerate(tasks):
        conversation = None
        if chat is None:
            ids, sources = encode_prompt(tokenizer, env, task, hints[i] if hints else None, hint_position)
        else:
            conversation = chat.start(env.system_prompt(task), env.tools(task), env.user_message(task))
            ids = chat.encode(conversation.text)
            sources = [int(Source.PROMPT)] * len(ids)
        traj = Trajectory(task_id=task.id, token_ids=[], sources=[], logprobs=[], group=groups[i] if groups else -1)
        rows.append(_Row(task=task, episode=env.start(task), ids=ids, sources=sources, logprobs=[0.0] * len(ids), traj=traj,
                         conversation=conversation))
    t0 = time.perf_counter()
    append_s = 0.0
    attention = contextlib.ExitStack()
    try:
        attention.enter_context(_cascade_attention(model, device.type == "cpu"))
        decoder = LeanDecoder.build(model, len(rows)) if lean else None  # copies of this rollout's weights
        logits, cache, attn = _prefill(model, [r.ids for r in rows], device, decoder)
        prefill_s = time.perf_counter() - t0  # the decoder's weight layout included
        prefix = getattr(cache.layers[0], "prefix", None)
        prefix_cols = prefix[0].shape[-2] if prefix is not None else 0  # attn columns not in the rows' cache
        for r in rows:
            r.n_valid = len(r.ids)
        live = list(range(len(rows)))  # rows in the batch, in batch order
        while live:
            # ---- one assistant turn for every row in the batch (all active here) ----
            B = len(live)
            gen = [True] * B
            gens = [generator[i] for i in live] if isinstance(generator, (list, tuple)) else generator
            for i in live:
                r = rows[i]
                r.turn_start = len(r.ids)
                r.forced = steer(i, r.turn) if steer else None
            while True:
                tok, logp = _choose(logits, params, gens, gen)
                # the step's inputs as Python lists, made tensors once (not 3 × B element writes)
                toks, lps = tok.tolist(), logp.tolist()
                feed, col, positions = [pad] * B, [0] * B, [0] * B
                for b, i in enumerate(live):
                    if not gen[b]:
                        continue
                    r = rows[i]
                    k = len(r.ids) - r.turn_start
                    t = toks[b]
                    lp = lps[b]
                    if r.forced is not None and k < len(r.forced):
                        t = r.forced[k]
                        lp = float(torch.log_softmax(logits[b] / (1.0 if params.greedy else params.temperature), -1)[t])
                    r.ids.append(t)
                    r.sources.append(Source.POLICY)
                    r.logprobs.append(lp)
                    feed[b] = t
                    col[b] = 1
                    positions[b] = r.n_valid
                    r.pending = [t]
                    if t == eos or k + 1 >= params.max_new_tokens or len(r.ids) >= params.max_total_tokens:
                        gen[b] = False
                if not any(gen):
                    break
                step_ids, step_positions = (torch.tensor(x, dtype=torch.long, device=device)[:, None] for x in (feed, positions))
                attn = torch.cat([attn, torch.tensor(col, dtype=attn.dtype, device=device)[:, None]], dim=1)
                if decoder is not None:
                    logits = decoder.step(step_ids, attn, step_positions, cache)
                else:
                    logits, cache = _forward(model, step_ids, attn, step_positions, cache)
                for b, i in enumerate(live):
                    if col[b]:
                        rows[i].n_valid += 1
                        rows[i].pending = []
            # ---- execute calls, decide who continues, append tool responses ----
            blocks: dict[int, list[int]] = {}  # batch position → tokens to append
            for b, i in enumerate(live):
                r = rows[i]
                turn_ids = r.ids[r.turn_start :]
                ended_cleanly = turn_ids[-1] == eos
                # a template compares this text with its own rendering: no clean-up of spaces (Llama's tokenizer does it)
                text = tokenizer.decode(turn_ids[:-1] if ended_cleanly else turn_ids, skip_special_tokens=False,
                                        **({"clean_up_tokenization_spaces": False} if chat is not None else {}))
                r.traj.turn_spans.append((r.turn_start, len(r.ids)))
                r.traj.turn_texts.append(text)
                r.turn += 1
                if not ended_cleanly and (params.on_cut == "stop" or len(r.ids) >= params.max_total_tokens):
                    r.traj.truncated = True  # cut at the per-turn or episode token limit
                    r.active = False
                    continue
                close = [] if ended_cleanly else [eos]  # on_cut="continue": the engine ends the cut turn (not a policy token)
                if close:
                    r.traj.info["cut_turns"] = r.traj.info.get("cut_turns", 0) + 1
                outcome = process_turn(r.episode, text, r.turn - 1, parse=chat.parse if chat is not None else None)
                r.traj.steps.extend(outcome.steps)
                if outcome.answer is not None:
                    r.traj.answer = outcome.answer
                if outcome.final:
                    r.traj.finished = True
                    r.active = False
                    continue
                if r.turn >= (turn_limits[i] if turn_limits is not None else params.max_turns):
                    r.traj.truncated = True
                    r.active = False
                    continue
                if r.conversation is None:
                    suffix = render_tool_responses(outcome.results) if outcome.steps else render_user_turn(outcome.next_user or "")
                else:
                    suffix = r.conversation.respond(text, outcome.results, outcome.next_user)
                    if suffix is None:  # the template does not render this turn as sampled (keel.templates)
                        r.traj.truncated = True
                        r.traj.info["template_mismatch_turn"] = r.turn - 1
                        r.active = False
                        continue
                suffix_ids = close + tokenizer.encode(suffix, add_special_tokens=False)
                if len(r.ids) + len(suffix_ids) + 1 > params.max_total_tokens:
                    r.traj.truncated = True
                    r.active = False
                    continue
                r.ids.extend(suffix_ids)
                r.sources.extend([Source.TOOL] * len(suffix_ids))
                r.logprobs.extend([0.0] * len(suffix_ids))
                blocks[b] = r.pending + suffix_ids
            if not blocks:
                break
            # rows that ended leave the batch, and the cache drops its hole columns
            t_append = time.perf_counter()
            keep = sorted(blocks)
            cache, attn = _compact(cache, attn, keep, prefix_cols)
            live = [live[b] for b in keep]
            width = max(len(blocks[b]) for b in keep)
            B = len(live)
            feed = torch.full((B, width), pad, dtype=torch.long, device=device)
            block_mask = torch.zeros(B, width, dtype=torch.long, device=device)
            positions = torch.zeros(B, width, dtype=torch.long, device=device)
            for nb, (b, i) in enumerate(zip(keep, live)):
                r, blk = rows[i], blocks[b]
                # right-align each row's tokens so the last column is every continuing row's last token
                feed[nb, width - len(blk) :] = torch.tensor(blk, device=device)
                block_mask[nb, width - len(blk) :] = 1
                positions[nb, width - len(blk) :] = torch.arange(r.n_valid, r.n_valid + len(blk), device=device)
                r.n_valid += len(blk)
                r.pending = []
            attn = torch.cat([attn, block_mask], dim=1)
            logits, cache = _block(model, decoder, feed, attn, positions, cache)
            append_s += time.perf_counter() - t_append
    finally:
        attention.close()
        for r in rows:
            try:
                r.episode.close()
                r.traj.info.update(episode_info(r.episode))  # e.g. BFCL's checker_valid
            except Exception as exc:  # a failing close must not lose the batch
                r.traj.info["close_error"] = f"{type(exc).__name__}: {exc}"
        if was_training:
            model.train()
    elapsed = time.perf_counter() - t0
    out = []
    for r in rows:
        tr = r.traj
        tr.token_ids, tr.sources, tr.logprobs = r.ids, [int(s) for s in r.sources], r.logprobs
        # the batch's seconds: all, encoding the prompts (and laying out the decoder's weights), appending tool responses
        # (the rest is decoding)
        tr.info.update(rollout_s=elapsed, prefill_s=prefill_s, append_s=append_s)
        out.append(tr)
    return out
