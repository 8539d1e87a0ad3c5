"""What happens after an assistant turn, shared by every policy (model, oracle, null, endpoint).

One rule set, so a scripted policy and a sampled model are scored identically:
- the turn's <tool_call> blocks are parsed; each call (even a malformed one) is executed and
  its observation appended as a tool response;
- a turn without any <tool_call> block ends the current user turn: the environment may supply
  the next user message (multi-turn conversations), otherwise the episode ends and the
  turn's answer (see `keel.chat.extract_answer`) is the episode's answer.

`run_text_episode` drives a text policy (a function from messages to assistant text) through
this loop; the rollout engine (`keel.rollout`) drives a model through the same `process_turn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from keel.chat import extract_answer, parse_tool_calls
from keel.types import Env, Episode, Step, Task, Trajectory, begin_step, episode_info, episode_parser


@dataclass
class TurnOutcome:
    steps: list[Step]
    results: list[str]  # observation texts, in call order (what the model will see)
    final: bool  # the episode is over
    answer: str | None  # set when the turn had no call
    next_user: str | None  # a new user message to append (no calls, conversation continues)


def process_turn(episode: Episode, text: str, turn: int, parse: Callable[[str], list] | None = None) -> TurnOutcome:
    """Parse and execute the calls of one assistant turn. Never raises on model text.

    `parse`: the chat format's call parser (keel.templates), used unless the episode has its own.
    """
    # An episode may bring its own parser (function calling reads Python-call syntax too) and
    # count steps per turn (BFCL's step limit); the KG env uses the Hermes JSON parser, or the
    # chat template family's.
    calls = (episode_parser(episode) or parse or parse_tool_calls)(text)
    if calls:
        begin_step(episode)
        steps = []
        for call in calls:
            try:
                obs = episode.execute(call)
            except Exception as exc:  # an env bug must not kill a long run; it becomes the tool's answer
                from keel.types import Observation

                obs = Observation(text=f"ERROR: tool failed: {type(exc).__name__}", ok=False, error="env_exception")
            steps.append(Step(turn=turn, call=call, observation=obs))
        return TurnOutcome(steps=steps, results=[s.observation.text for s in steps], final=False, answer=None, next_user=None)
    answer = extract_answer(text)
    nxt = episode.next_user_message()
    if nxt is None:
        return TurnOutcome(steps=[], results=[], final=True, answer=answer, next_user=None)
    return TurnOutcome(steps=[], results=[], final=False, answer=answer, next_user=nxt)


@dataclass
class TextEpisode:
    task_id: str
    messages: list[dict[str, Any]]
    turn_texts: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None
    finished: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # what the episode reported on close (e.g. checker_valid)

    def to_trajectory(self) -> Trajectory:
        """The same episode as a token-less Trajectory, so every scorer reads one type."""
        return Trajectory(task_id=self.task_id, token_ids=[], sources=[], logprobs=[], turn_texts=list(self.turn_texts),
                          steps=list(self.steps), answer=self.answer, finished=self.finished, truncated=self.truncated, info=dict(self.info))


TextPolicy = Callable[[Task, list[dict[str, Any]]], str]


def run_text_episode(env: Env, task: Task, policy: TextPolicy, max_turns: int) -> TextEpisode:
    """Drive a text policy through one episode. `messages` use roles system/user/assistant/tool."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": env.system_prompt(task)},
        {"role": "user", "content": env.user_message(task)},
    ]
    out = TextEpisode(task_id=task.id, messages=messages)
    episode = env.start(task)
    try:
        for turn in range(max_turns):
            text = policy(task, messages)
            messages.append({"role": "assistant", "content": text})
            out.turn_texts.append(text)
            outcome = process_turn(episode, text, turn)
            out.steps.extend(outcome.steps)
            for r in outcome.results:
                messages.append({"role": "tool", "content": r})
            if outcome.answer is not None:
                out.answer = outcome.answer
            if outcome.final:
                out.finished = True
                break
            if outcome.next_user is not None:
                messages.append({"role": "user", "content": outcome.next_user})
        else:
            out.truncated = True
    finally:
        episode.close()
        out.info.update(episode_info(episode))
    return out
