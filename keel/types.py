"""The few concepts Keel is built from: Task, ToolCall, Observation, Step, Trajectory, Env, Episode.

Every other module speaks in these types. A Trajectory is token-in/token-out: `token_ids`
are exactly the ids the policy sampled (plus the prompt and tool text spliced in between),
and every loss mask is derived from `sources`, never rebuilt ad hoc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Protocol


class Source(IntEnum):
    """Where a token of a trajectory came from. Loss masks are derived from this alone."""

    PROMPT = 0  # system + user text and the chat-template scaffolding around it
    POLICY = 1  # sampled by the policy (includes the <|im_end|> that closes its turn)
    TOOL = 2  # tool responses and the template tokens that wrap them
    HINT = 3  # guidance shown only while sampling; never part of a trained sequence
    EXPERT = 4  # gold actions written into a trajectory (off-policy supervision)
    REFLECTION = 5  # analyzer-written reflection text (process reflection supervision)


@dataclass
class Task:
    """One question (or conversation) with its gold answer and, where known, gold trajectory.

    `answers[0]` is the primary gold answer (F1 is computed against it); EM accepts any of
    `answers` or `aliases`. `gold_turns` is the gold trajectory: one list of calls per
    assistant turn, each call `{"name": verb, "arguments": {...}}`; the final answer turn is
    not included (it is `answers[0]`). `gold_triples` are the (head, relation, tail) ids of
    the gold path, used by process rewards and the error decomposition.
    """

    id: str
    question: str
    answers: list[str]
    aliases: list[str] = field(default_factory=list)
    answer_ids: list[str] = field(default_factory=list)
    topic_entities: dict[str, str] = field(default_factory=dict)  # id -> name
    gold_turns: list[list[dict[str, Any]]] = field(default_factory=list)
    gold_triples: list[tuple[str, str, str]] = field(default_factory=list)
    kind: str = ""  # composition / conjunction / comparative / superlative / 2-hop ...
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "answers": list(self.answers),
            "aliases": list(self.aliases),
            "answer_ids": list(self.answer_ids),
            "topic_entities": dict(self.topic_entities),
            "gold_turns": self.gold_turns,
            "gold_triples": [list(t) for t in self.gold_triples],
            "kind": self.kind,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Task":
        return cls(
            id=str(d["id"]),
            question=d["question"],
            answers=list(d["answers"]),
            aliases=list(d.get("aliases", [])),
            answer_ids=list(d.get("answer_ids", [])),
            topic_entities=dict(d.get("topic_entities", {})),
            gold_turns=d.get("gold_turns", []),
            gold_triples=[tuple(t) for t in d.get("gold_triples", [])],
            kind=d.get("kind", ""),
            meta=d.get("meta", {}),
        )


def is_function_calling(task: Task) -> bool:
    """A function-calling task: its gold is the calls of each user turn (`gold_turns[t]`, `[]` for
    a turn answered in prose), an episode succeeds by a checker's verdict (`info["checker_valid"]`)
    and there is no answer text. The loaders mark it: BFCL (multi- and single-turn) and fc_learn
    put BFCL's entry in `meta["entry"]`; BFCL multi-turn, fc_learn and ACEBench the ground truth
    in `meta["ground_truth"]`. Every other task (KG, tools, MCP) is a question answered in text.
    The one test of "is this function calling?"; the tasks Keel trains on (fc_learn) carry both."""
    return "ground_truth" in task.meta or isinstance(task.meta.get("entry"), dict)


@dataclass
class ToolCall:
    """A tool call as parsed from model text. `error` is set when the text was not a valid call;
    such a call is still executed (the env turns the error into the tool's answer)."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""
    error: str | None = None

    def signature(self) -> str:
        """Canonical string of name + arguments (sorted keys): equal calls have equal signatures."""
        import json

        return self.name + json.dumps(self.arguments, sort_keys=True, ensure_ascii=False)


@dataclass
class Observation:
    """What a tool returned. `text` is what the model sees. `ok` is False for a malformed call
    or a failed query; `error` is the machine-readable reason (`bad_json`, `unknown_tool`,
    `bad_arguments`, `unknown_entity`, `no_result`, ...) whether or not the text shows it.

    Rewards and metrics read `result_text` (the tool's own output), never `text`: an env may
    show the model more than the tool returned (the KG oracle ablation appends a hint), and a
    hint must not make a failed call look non-empty. `resolved` is the call as the env
    executed it, after resolving how the model spelled it (KG: (verb, entity id, relation),
    relation "" for the relation verbs), so that one call written two ways counts once.
    Both are None in trajectories saved before they existed, and where an env sets neither.
    """

    text: str
    ok: bool = True
    error: str | None = None
    items: list[str] | None = None  # structured result (e.g. the returned ids), when there is one
    result: str | None = None  # the tool's own output when `text` adds to it; None: `text` is the output
    resolved: tuple[str, ...] | None = None  # the executed call; None when it never reached the backend

    @property
    def result_text(self) -> str:
        """The tool's own output, without what the env added for the model only."""
        return self.text if self.result is None else self.result


@dataclass
class Step:
    """One tool call with its observation, in assistant turn `turn` (0-based)."""

    turn: int
    call: ToolCall
    observation: Observation


@dataclass
class Trajectory:
    """One whole multi-turn episode, token-in/token-out.

    token_ids[i], sources[i], logprobs[i] describe token i. `logprobs` holds the sampling
    log-prob (temperature-scaled distribution) for POLICY tokens and 0.0 elsewhere.
    `turn_spans` are the [start, end) token ranges of each assistant turn (policy tokens).
    Worked example (ids abbreviated):
        token_ids: [p p p | a a a E | t t t t | a a E]
        sources:   [0 0 0 | 1 1 1 1 | 2 2 2 2 | 1 1 1]
        turn_spans: [(3, 7), (11, 14)]
    """

    task_id: str
    token_ids: list[int]
    sources: list[int]
    logprobs: list[float]
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    answer: str | None = None  # the final answer text, None when the episode never answered
    finished: bool = False  # the policy ended the episode itself (an answer turn)
    truncated: bool = False  # hit the turn or token limit
    group: int = -1  # index of the GRPO group this trajectory belongs to
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return self.turn_spans[0][0] if self.turn_spans else len(self.token_ids)

    @property
    def num_policy_tokens(self) -> int:
        return sum(1 for s in self.sources if s == Source.POLICY)

    @property
    def text(self) -> str:
        """All assistant text, turns joined by newlines (for rewards that read the whole output)."""
        return "\n".join(self.turn_texts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "token_ids": self.token_ids,
            "sources": self.sources,
            "logprobs": [round(x, 6) for x in self.logprobs],
            "turn_spans": [list(s) for s in self.turn_spans],
            "turn_texts": self.turn_texts,
            "steps": [
                {
                    "turn": s.turn,
                    "call": {"name": s.call.name, "arguments": s.call.arguments, "raw": s.call.raw, "error": s.call.error},
                    "observation": {
                        "text": s.observation.text,
                        "ok": s.observation.ok,
                        "error": s.observation.error,
                        "items": s.observation.items,
                        "result": s.observation.result,
                        "resolved": list(s.observation.resolved) if s.observation.resolved is not None else None,
                    },
                }
                for s in self.steps
            ],
            "answer": self.answer,
            "finished": self.finished,
            "truncated": self.truncated,
            "group": self.group,
            "reward": self.reward,
            "reward_components": self.reward_components,
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        steps = [
            Step(
                turn=s["turn"],
                call=ToolCall(**s["call"]),
                observation=_observation(s["observation"]),
            )
            for s in d.get("steps", [])
        ]
        return cls(
            task_id=d["task_id"],
            token_ids=list(d["token_ids"]),
            sources=list(d["sources"]),
            logprobs=list(d["logprobs"]),
            turn_spans=[tuple(s) for s in d.get("turn_spans", [])],
            turn_texts=list(d.get("turn_texts", [])),
            steps=steps,
            answer=d.get("answer"),
            finished=d.get("finished", False),
            truncated=d.get("truncated", False),
            group=d.get("group", -1),
            reward=d.get("reward", 0.0),
            reward_components=d.get("reward_components", {}),
            info=d.get("info", {}),
        )


def _observation(d: dict[str, Any]) -> Observation:
    """An Observation from its dict; JSON has no tuples, so `resolved` comes back as a list."""
    d = dict(d)
    if d.get("resolved") is not None:
        d["resolved"] = tuple(d["resolved"])
    return Observation(**d)


class Episode(Protocol):
    """The environment's side of one episode. Created by `Env.start(task)`.

    Required: the rollout engine calls `execute` for each parsed call of an assistant turn,
    `next_user_message` when an assistant turn has no call (None ends the episode), and `close`
    at the end (release simulators, caches; a checker may judge the episode here).

    Optional, declared here with their defaults (None: the episode has none); an episode that
    does not subclass Episode may leave them out, so the engine reads them through the
    functions below this class:
    - `parse(text) -> list[ToolCall]`: the episode's own call parser (function calling reads
      Python-call syntax too); default: the chat format's (Keel's Hermes <tool_call> JSON, or
      the model template family's). `episode_parser(episode)`.
    - `begin_step()`: called once per assistant turn that has calls, before they execute
      (BFCL's step limit counts turns); default: nothing. `begin_step(episode)`.
    - `info: dict`: read after `close`, merged into the trajectory's `info` (BFCL's
      `checker_valid`, which the function-calling rewards read); default: {}. `episode_info(episode)`.
    """

    parse: Callable[[str], list[ToolCall]] | None = None
    begin_step: Callable[[], None] | None = None
    info: dict[str, Any] | None = None

    def execute(self, call: ToolCall) -> Observation: ...

    def next_user_message(self) -> str | None: ...

    def close(self) -> None: ...


def episode_parser(episode: Episode) -> Callable[[str], list[ToolCall]] | None:
    """The episode's own call parser, None when it has none (the caller's format parses)."""
    return getattr(episode, "parse", Episode.parse)


def begin_step(episode: Episode) -> None:
    """Tell the episode an assistant turn with calls begins (a no-op for most envs)."""
    begin = getattr(episode, "begin_step", Episode.begin_step)
    if begin is not None:
        begin()


def episode_info(episode: Episode) -> dict[str, Any]:
    """What the episode reported (after `close`); {} when it reports nothing."""
    return dict(getattr(episode, "info", Episode.info) or {})


class Env(Protocol):
    """A tool environment: its tool schemas, how a task is presented, and episodes.

    Required: `name`, `tools`, `system_prompt`, `user_message`, `start`.
    Optional, declared here with their defaults (an env that does not subclass Env may leave
    them out: the engine reads them through the functions below this class):
    - `call_format: str`: how calls are written — "json" (Hermes <tool_call> JSON, the default),
      "python" or "python_tagged" (BFCL's format-OOD axis); gold texts, hints and reflections
      write calls in it. `env_call_format(env)`.
    - `close()`: release what the env holds for the whole run (an MCP tool server's process),
      called once when the run or evaluation ends; default: nothing. `close_env(env)`.
    """

    name: str
    call_format: str = "json"
    close: Callable[[], None] | None = None

    def tools(self, task: Task) -> list[dict[str, Any]]:
        """JSON schemas of the tools offered for this task (OpenAI function format)."""
        ...

    def system_prompt(self, task: Task) -> str:
        """Instructions shown before the tools list (format rules, answer tags)."""
        ...

    def user_message(self, task: Task) -> str:
        """The first user message of the episode."""
        ...

    def start(self, task: Task) -> Episode: ...


def env_call_format(env: Env | None) -> str:
    """The env's call format; "json" when it declares none (or there is no env)."""
    return getattr(env, "call_format", Env.call_format) if env is not None else Env.call_format


def close_env(env: Env | None) -> None:
    """Release what the env holds for the run, if it holds anything (`Env.close`)."""
    close = getattr(env, "close", Env.close)
    if callable(close):
        close()
