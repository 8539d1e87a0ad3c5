"""Scripted text policies for the function-calling environments, and the episode driver.

`oracle` replays the gold calls through the same parser and executor a model goes through, so
it measures the environment (it must score 100%); `null` never calls a tool, so it measures
what the benchmark gives for doing nothing. Both are `fn(task, messages) -> str`.

`run_fc_episode` is `keel.episode.run_text_episode` with two additions the function-calling
envs need: the episode's own parser (Python-call formats, the format-OOD axis) and a
`begin_step()` call before the calls of each assistant message (BFCL's step grouping). With
call_format "json" and no begin_step it makes the same calls in the same order, which a test
checks against run_text_episode.
"""

from __future__ import annotations

from typing import Any, Callable

from keel.chat import extract_answer, parse_tool_calls
from keel.episode import TextEpisode
from keel.fc.parse import render_calls
from keel.types import Env, Observation, Step, Task, begin_step, episode_info, episode_parser

DONE_TEXT = "I have finished the requested operations."
NULL_TEXT = "I cannot help with that."

TextPolicy = Callable[[Task, list[dict[str, Any]]], str]


def make_oracle(call_format: str = "json") -> TextPolicy:
    """Gold calls of the current user turn in one message, then a closing message without calls.

    The user turn is the count of user messages so far; a message after tool results closes the
    turn. Turns whose gold is `[]` (miss_param / miss_func, ACEBench special) are answered in
    prose, or with the task's `meta["gold_text"]` when it has one.
    """

    def oracle(task: Task, messages: list[dict[str, Any]]) -> str:
        k = sum(1 for m in messages if m["role"] == "user") - 1
        last = messages[-1]["role"]
        gold = task.gold_turns[k] if 0 <= k < len(task.gold_turns) else []
        if last == "user" and gold:
            return render_calls(gold, call_format)
        return task.meta.get("gold_text") or DONE_TEXT

    return oracle


def null_policy(task: Task, messages: list[dict[str, Any]]) -> str:
    return NULL_TEXT


def run_fc_episode(env: Env, task: Task, policy: TextPolicy, max_turns: int) -> tuple[TextEpisode, dict[str, Any]]:
    """Drive a text policy through one episode; returns the episode record and `episode.info`
    (read after `close()`, where the BFCL verdict is computed)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": env.system_prompt(task)},
        {"role": "user", "content": env.user_message(task)},
    ]
    out = TextEpisode(task_id=task.id, messages=messages)
    episode = env.start(task)
    parse = episode_parser(episode) or parse_tool_calls
    try:
        for turn in range(max_turns):
            text = policy(task, messages)
            messages.append({"role": "assistant", "content": text})
            out.turn_texts.append(text)
            try:
                calls = parse(text)
            except Exception:  # a parser must not raise; if one does, the turn has no calls
                calls = []
            if calls:
                begin_step(episode)
                for call in calls:
                    try:
                        obs = episode.execute(call)
                    except Exception as exc:
                        obs = Observation(text=f"ERROR: tool failed: {type(exc).__name__}", ok=False, error="env_exception")
                    out.steps.append(Step(turn=turn, call=call, observation=obs))
                    messages.append({"role": "tool", "content": obs.text})
                continue
            out.answer = extract_answer(text)
            nxt = episode.next_user_message()
            if nxt is None:
                out.finished = True
                break
            messages.append({"role": "user", "content": nxt})
        else:
            out.truncated = True
    finally:
        episode.close()
    return out, episode_info(episode)
