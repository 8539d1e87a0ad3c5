"""Gold trajectories and paper A's single-step SFT decomposition.

Paper A (Eq. 3) decomposes each gold multi-turn trajectory into single steps: one example per
assistant turn, whose context is everything before that turn and whose target is that turn.
For a causal model, the loss on turn t with its exact prefix is the same whether computed as a
separate example or inside one forward pass over the whole trajectory with every assistant
turn as a target; `packed=True` does the latter (about turns× fewer tokens) and
tests/test_sft.py checks the two agree.

Gold trajectories are built the way a rollout is: the prompt through `encode_prompt`, each
gold turn's text encoded on its own and closed with <|im_end|>, each tool response rendered by
the real environment, so SFT trains exactly the token layout the policy will sample in. With the
model's own chat template (`chat`, keel.templates) the same holds in its layout: its prompt, the
gold calls written in its family's format and closed by its end-of-turn token, its deltas.
`gold_trajectory` is the one builder: the SFT warm-start, the `keel data check` replay and the
supervision signals (the SFT pool, ETS, OPS members; keel.signals) all take theirs from it, the
signals through one cache per run (`cached_gold_trajectory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from keel.chat import IM_END, render_assistant_calls, render_tool_responses, render_user_turn
from keel.episode import process_turn
from keel.logprobs import collate, micro_batches, token_logprobs, training_passes, update_prefix
from keel.losses import sft_loss
from keel.models import no_autocast
from keel.rollout import encode_prompt
from keel.templates import ChatTemplate
from keel.types import Env, Source, Task, Trajectory, env_call_format, episode_info, is_function_calling


def gold_turn_texts(task: Task, render_calls: Callable[[list[dict[str, Any]]], str] = render_assistant_calls) -> list[str]:
    """Assistant texts of the gold trajectory, calls written by `render_calls` (Hermes
    <tool_call> blocks; a chat template's family writes its own, keel.templates).

    - `meta["gold_texts"]` when a loader wrote full texts;
    - function calling (`keel.types.is_function_calling`): per user turn, one message with
      all its gold calls and then a closing message without calls (a turn whose gold is `[]`
      is answered in prose) — exactly what `keel.fc.policies.make_oracle` sends;
    - KG: one turn per `gold_turns` entry (its calls) plus a final `<answer>` turn.
    """
    if task.meta.get("gold_texts"):
        return list(task.meta["gold_texts"])
    if is_function_calling(task):
        from keel.fc.policies import DONE_TEXT

        texts = []
        for calls in task.gold_turns:
            if calls:
                texts.append(render_calls(calls))
            texts.append(task.meta.get("gold_text") or DONE_TEXT)
        return texts
    texts = [render_calls(calls) for calls in task.gold_turns if calls]
    texts.append(f"<answer>{task.answers[0]}</answer>")
    return texts


def gold_texts(task: Task, env: Env | None = None) -> list[str]:
    """Assistant texts of the gold trajectory in `env`: `gold_turn_texts` (KG: a turn of calls
    per gold turn, then `<answer>`; function calling: per user turn its gold calls, then the
    closing text of Keel's oracle), with the calls in the env's call format when it is not
    Hermes JSON (BfclEnv("python") / ("python_tagged"), the format-OOD axis)."""
    fmt = env_call_format(env)
    if not is_function_calling(task) and not task.answers and not task.meta.get("gold_texts"):
        raise ValueError(f"task {task.id!r}: no gold answer, so no gold trajectory")
    if fmt == "json" or task.meta.get("gold_texts") or not is_function_calling(task):
        return gold_turn_texts(task)
    from keel.fc.parse import render_calls

    return gold_turn_texts(task, lambda calls: render_calls(calls, fmt))


def gold_trajectory(tokenizer, env: Env, task: Task, source: int = Source.EXPERT, hint: str | None = None,
                    chat: ChatTemplate | None = None) -> Trajectory:
    """The gold episode as a Trajectory whose assistant tokens carry `source` (EXPERT by default),
    for KG and function calling; its texts are `gold_texts` (the env's call format).

    Tool responses come from executing the gold calls in `env`, so a gold trajectory is also a
    check that the gold path works there: `info["gold_ok"]` is False if a gold call failed or,
    for function calling, BFCL's checker refused it (`info["checker_valid"]`), so rewards score
    it like a rollout; `info["expert"]` is True.
    `chat`: render it with the model's own template, as `rollout(chat=...)` renders an episode
    (a gold turn the template does not reproduce ends it, `gold_ok` False). Hints are Hermes-only.
    """
    if chat is not None and hint:
        raise ValueError("gold_trajectory: hints need Keel's Hermes format (encode_prompt's layout); not available with a chat template")
    conversation = None
    if chat is None:
        ids, sources = encode_prompt(tokenizer, env, task, hint)
        eos = tokenizer.convert_tokens_to_ids(IM_END)
    else:
        conversation = chat.start(env.system_prompt(task), env.tools(task), env.user_message(task))
        ids = chat.encode(conversation.text)
        sources = [int(Source.PROMPT)] * len(ids)
        eos = chat.end_id
    logprobs = [0.0] * len(ids)
    tr = Trajectory(task_id=task.id, token_ids=[], sources=[], logprobs=[])
    episode = env.start(task)
    gold_ok = True
    try:
        texts = gold_texts(task, env) if chat is None else gold_turn_texts(task, chat.render_calls)
        for turn, text in enumerate(texts):
            turn_ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
            start = len(ids)
            ids += turn_ids
            sources += [source] * len(turn_ids)
            logprobs += [0.0] * len(turn_ids)
            tr.turn_spans.append((start, len(ids)))
            tr.turn_texts.append(text)
            outcome = process_turn(episode, text, turn, parse=chat.parse if chat is not None else None)
            tr.steps.extend(outcome.steps)
            gold_ok &= all(s.observation.ok for s in outcome.steps)
            if outcome.answer is not None:
                tr.answer = outcome.answer
            if outcome.final or turn == len(texts) - 1:
                tr.finished = outcome.final
                break
            if conversation is None:
                suffix = render_tool_responses(outcome.results) if outcome.steps else render_user_turn(outcome.next_user or "")
            else:
                suffix = conversation.respond(text, outcome.results, outcome.next_user)
                if suffix is None:  # the template does not render this gold turn as written (keel.templates)
                    tr.truncated, gold_ok = True, False
                    tr.info["template_mismatch_turn"] = turn
                    break
            s_ids = tokenizer.encode(suffix, add_special_tokens=False)
            ids += s_ids
            sources += [Source.TOOL] * len(s_ids)
            logprobs += [0.0] * len(s_ids)
    finally:
        episode.close()
    tr.token_ids, tr.sources, tr.logprobs = ids, [int(s) for s in sources], logprobs
    tr.info.update(episode_info(episode))  # e.g. BFCL's checker_valid
    tr.info["gold_ok"] = gold_ok and tr.info.get("checker_valid", True)
    tr.info["expert"] = True
    return tr


def cached_gold_trajectory(tokenizer, env: Env, task: Task, cache: dict[str, Trajectory] | None) -> Trajectory:
    """`gold_trajectory(tokenizer, env, task)` from `cache` (task id -> trajectory) when it is
    there, else built (and kept when there is a cache). Gold trajectories are deterministic, so a
    cache is not state a checkpoint keeps: one per run (keel.signals.state.SignalState.gold_cache)."""
    gold = cache.get(task.id) if cache is not None else None
    if gold is None:
        gold = gold_trajectory(tokenizer, env, task)
        if cache is not None:
            cache[task.id] = gold
    return gold


# Sources an SFT example is trained on; every other token of an example is context.
SFT_TARGETS = (Source.EXPERT, Source.POLICY, Source.REFLECTION)


@dataclass
class SFTExample:
    """An SFT row: token ids with their per-token sources, as a trajectory's, so it goes through
    the same `keel.logprobs.collate` as RL rows. The loss is on the tokens whose source is in
    `SFT_TARGETS`; `decompose` marks everything else (prompt, tool results, the earlier turns of
    a single-step example) `Source.PROMPT`."""

    token_ids: list[int]
    sources: list[int]
    task_id: str = ""
    turn: int = -1  # -1 for a packed example (all turns)

    @property
    def targets(self) -> list[bool]:
        return [s in SFT_TARGETS for s in self.sources]

    @property
    def logprobs(self) -> list[float]:  # what `collate` reads as old log-probs; SFT has none
        return [0.0] * len(self.token_ids)


def decompose(tr: Trajectory, target_sources: tuple[int, ...] = (Source.EXPERT, Source.POLICY), packed: bool = False) -> list[SFTExample]:
    """Paper A's single-step decomposition: one example per assistant turn.

    Worked example: turn spans [(5, 9), (14, 17)] → example 0 = ids[:9] with targets 5..8,
    example 1 = ids[:17] with targets 14..16 (turn 0 is context there, not a target).
    `packed=True` gives one example ids[:17] with both turns as targets.
    """
    unknown = set(target_sources) - set(SFT_TARGETS)
    if unknown:
        raise ValueError(f"decompose: target sources {sorted(unknown)} are not SFT target sources {list(SFT_TARGETS)}")

    def example(end: int, spans: list[tuple[int, int]], turn: int) -> SFTExample:
        sources = [int(Source.PROMPT)] * end
        for a, b in spans:
            for i in range(a, b):
                if tr.sources[i] in target_sources:
                    sources[i] = int(tr.sources[i])
        return SFTExample(tr.token_ids[:end], sources, tr.task_id, turn)

    if packed:
        return [example(tr.turn_spans[-1][1], list(tr.turn_spans), -1)]
    return [example(b, [(a, b)], k) for k, (a, b) in enumerate(tr.turn_spans)]


def collate_sft(examples: list[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ input_ids [B, T], attention_mask [B, T], target_mask [B, T] (right-padded): `collate`'s,
    with the SFT target sources as targets and nothing dropped."""
    batch = collate(examples, SFT_TARGETS, pad_id, drop_sources=())
    return batch.input_ids, batch.attention_mask, batch.target_mask


def supervision_backward(model, examples: Sequence, pad_id: int, weight: float = 1.0, micro: int = 8, autocast: bool = False,
                         max_tokens: int = 0, keep_prefix_graph: bool = True) -> float:
    """Accumulate gradients of weight · NLL over the examples' targets (token-mean over all of
    them, `keel.losses.sft_loss`); no optimizer step. Returns the unweighted loss.

    Synchronous paradigm: call it inside the RL update, after the GRPO micro-batches' backward
    and before gradient clipping, once per kind with `Schedule.sync_weight(kind)`.
    `autocast`: bf16 autocast of the forward, as train.py's `model.autocast`; micro-batches hold at
    most `micro` examples and `max_tokens` encoded positions (`keel.logprobs.micro_batches`), and
    the examples' common prefix is encoded once for all of them (`keel.logprobs.SharedPrefix`;
    `keep_prefix_graph`: `keel.logprobs.update_prefix`'s `keep_graph`, false for
    `model.recompute_shared_prefix`). train.py's `sft_step` is this plus the optimizer step.
    """
    if not examples:
        return 0.0
    n_targets = sum(sum(e.targets[1:]) for e in examples)
    total = 0.0
    device = next(model.parameters()).device
    sequences = [e.token_ids for e in examples]
    parts = micro_batches(sequences, micro, max_tokens)
    with training_passes(model, autocast):
        prefix = update_prefix(model, sequences, parts, max_tokens=max_tokens, keep_graph=keep_prefix_graph)
        for idx in parts:
            ids, attn, tmask = collate_sft([examples[i] for i in idx], pad_id)
            logp, _ = token_logprobs(model, ids.to(device), attn.to(device), tmask.to(device), prefix=prefix)
            loss = sft_loss(logp, n_targets)
            with no_autocast(model):
                (loss * weight).backward()
            total += float(loss.detach())
        if prefix is not None:
            prefix.backward()  # in the precision the prefix was encoded in
    return total
