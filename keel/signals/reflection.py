"""Process reflection supervision (PRS, paper A): learn to say which turn went wrong and how to fix it.

Paper A has an analyzer (an LLM, or an auxiliary analyser) read an intermediate trajectory plus
the ground truth and write a reflection r_τ — turn-by-turn error analysis and the corrected
calls — and trains the policy to generate r_τ conditioned on τ (Eq. 10; in their code, NLL on
the reflection text, interleaved with RL). Here:
- `RuleAnalyzer` (offline, default) replays the gold path in the environment and compares the
  trajectory with it: the first turn that went wrong, the cause (format error, unknown
  function, missing parameter, wrong arguments, wrong function, wrong entity, wrong relation,
  empty result, execution error, missing call, extra call, wrong answer, no answer) and the
  corrected calls. KG tasks reuse `keel.diagnostics.errors.classify_failure` for failures that
  no single call shows (relation selection, composition, answer extraction); function-calling
  tasks (BFCL, learnable) are compared user turn by user turn with the gold calls.
- `LLMAnalyzer` asks any OpenAI-compatible endpoint (`keel.endpoint`) for the same reflection.
- `reflection_example` makes the training example: context = the trajectory's own token ids
  (hints removed) + a rendered request for reflection, target = the reflection text
  (`Source.REFLECTION`), so the loss is NLL of the reflection given the trajectory.
Where Keel departs: the analyzer's wording is ours (theirs is not public); corrected calls are
written as plain JSON objects (or canonical Python calls), not inside <tool_call> tags, so that
reflection targets do not train control tags outside actions — paper A's collapse lives on
exactly those tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from keel import metrics as M
from keel.answers import exact_match
from keel.chat import IM_END, render_user_turn
from keel.config import SignalsConfig
from keel.kg.base import ENTITY_VERBS
from keel.rewards import is_empty_observation
from keel.sft import SFTExample, decompose
from keel.signals.base import Signal, SignalContext
from keel.types import Env, Source, Step, Task, ToolCall, Trajectory, begin_step, env_call_format, is_function_calling

# cause -> how the reflection names it
CAUSES: dict[str, str] = {
    "format_error": "format error",
    "unknown_function": "unknown function",
    "missing_parameter": "missing parameter",
    "wrong_arguments": "wrong arguments",
    "wrong_function": "wrong function",
    "wrong_entity": "wrong entity",
    "wrong_relation": "wrong relation",
    "empty_result": "empty result",
    "execution_error": "execution error",
    "missing_call": "missing call",
    "extra_call": "extra call",
    "wrong_answer": "wrong answer",
    "no_answer": "no answer",
}
REFLECTION_REQUEST = (
    "Review the episode above: say which turn went wrong and why, then give the corrected calls."
)
_SHOW = 160  # characters of a call argument or observation quoted in a reflection


@dataclass
class Reflection:
    """An analyzer's reflection on one failed trajectory. `turn` is the 0-based assistant turn
    that went wrong (-1 when the analyzer did not say); `text` is the training target."""

    task_id: str
    turn: int
    cause: str
    detail: str
    text: str
    corrected: list[list[dict[str, Any]]] = field(default_factory=list)


def succeeded(traj: Trajectory, task: Task) -> bool:
    """Function calling: BFCL's checker accepted the episode; KG: the answer is EM-correct."""
    if is_function_calling(task):
        return traj.info.get("checker_valid") is True
    return exact_match(traj.answer, list(task.answers) + list(task.aliases)) == 1.0


def _clip(text: Any, n: int = _SHOW) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def show_call(call: dict[str, Any], call_format: str = "json") -> str:
    """A call as plain text (no control tags): JSON for the json format, else canonical Python."""
    if call_format == "json":
        return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    from keel.fc.parse import canonical_call

    return canonical_call(call["name"], call["arguments"])


def render_reflection(turn: int, cause: str, detail: str, task: Task, call_format: str = "json") -> str:
    """The reflection text. Worked example (KG, wrong relation in the 2nd assistant turn):
        Turn 2 went wrong: wrong relation. <detail>
        Corrected calls:
        Turn 1: {"name": "get_tail_entities", "arguments": {...}}
        Turn 2: {"name": "get_tail_entities", "arguments": {...}}
        Answer: Paris
    Function calling lists the gold calls per user turn ("User turn 2: no call" for a turn
    whose gold is empty) and has no answer line.
    """
    where = f"Turn {turn + 1}" if turn >= 0 else "The episode"
    return f"{where} went wrong: {CAUSES.get(cause, cause)}. {detail}".rstrip() + "\n" + corrected_calls_text(task, call_format)


def corrected_calls_text(task: Task, call_format: str = "json") -> str:
    """"Corrected calls:" and the gold calls, one line per turn (the second half of a reflection)."""
    lines = ["Corrected calls:"]
    fc = is_function_calling(task)
    turns = task.gold_turns if fc else [t for t in task.gold_turns if t]
    for k, calls in enumerate(turns):
        label = f"User turn {k + 1}" if fc else f"Turn {k + 1}"
        lines.append(f"{label}: " + ("; ".join(show_call(c, call_format) for c in calls) if calls else "no call"))
    if not fc and task.answers:
        lines.append(f"Answer: {task.answers[0]}")
    return "\n".join(lines)


# --- the rule analyzer ----------------------------------------------------------------------------


def _required(env: Env, task: Task) -> dict[str, tuple[str, ...]]:
    """Function name -> required parameter names, from the env's tool schemas."""
    out = {}
    for t in env.tools(task):
        fn = t.get("function", t)
        out[fn.get("name", "")] = tuple(fn.get("parameters", {}).get("required", []))
    entry = task.meta.get("entry")  # BFCL's function documents
    if not out and isinstance(entry, dict):  # python call formats list no tools
        for d in entry.get("function", []):
            out[d["name"]] = tuple(d.get("parameters", {}).get("required", []))
    return out


class RuleAnalyzer:
    """Offline analyzer: replays the gold path in `env` and finds the first turn that went wrong.

    `analyze(traj, task)` returns None when the trajectory succeeded, or when the gold path
    itself fails in the env (a correction that does not work must not become a target).
    """

    name = "rule"

    def __init__(self, env: Env) -> None:
        self.env = env
        self.call_format = env_call_format(env)

    def analyze(self, traj: Trajectory, task: Task) -> Reflection | None:
        if succeeded(traj, task):
            return None
        if not self._gold_works(task):
            return None
        if is_function_calling(task):
            turn, cause, detail = self._function_calling(traj, task)
        else:
            turn, cause, detail = self._kg(traj, task)
        text = render_reflection(turn, cause, detail, task, self.call_format)
        return Reflection(task.id, turn, cause, detail, text, [list(t) for t in task.gold_turns])

    # -- gold replay --------------------------------------------------------------------------
    def _gold_works(self, task: Task) -> bool:
        """Run the gold calls in a fresh episode (user turns advanced in between)."""
        episode = self.env.start(task)
        try:
            for k, calls in enumerate(task.gold_turns):
                if k > 0 and is_function_calling(task):
                    episode.next_user_message()
                if calls:
                    begin_step(episode)
                for c in calls:
                    obs = episode.execute(ToolCall(name=c["name"], arguments=dict(c["arguments"])))
                    if not obs.ok:
                        return False
            return True
        finally:
            episode.close()

    # -- KG -------------------------------------------------------------------------------------
    def _entity_id(self, text: Any) -> str:
        from keel.kg.env import resolve_entity

        if not isinstance(text, str):
            return ""
        # the analyzer reads whatever the model wrote, so names always count
        return resolve_entity(self.env.store, text, accept_names=True) or text.strip()

    def _kg(self, traj: Trajectory, task: Task) -> tuple[int, str, str]:
        gold_calls = [c for turn in task.gold_turns for c in turn]
        gold_pairs = [(c["name"], self._entity_id(c["arguments"].get("entity")), str(c["arguments"].get("relation", ""))) for c in gold_calls]
        gold_entities = {e for _, e, _ in gold_pairs} | set(task.topic_entities) | {x for h, _, t in task.gold_triples for x in (h, t)}
        relations_of = {}
        for verb, e, r in gold_pairs:
            relations_of.setdefault(e, []).append(r)
        gold_relations = {r for _, _, r in gold_pairs if r}
        required = _required(self.env, task)
        for step in traj.steps:
            found = self._kg_step(step, required, gold_pairs, gold_entities, relations_of, gold_relations)
            if found is not None:
                return step.turn, found[0], found[1]
        last = len(traj.turn_texts) - 1
        if traj.answer is None:
            why = "truncated" if traj.truncated else "ended"
            return last, "no_answer", f"The episode {why} after {len(traj.turn_texts)} turns without an <answer>."
        if not traj.steps:
            return last, "missing_call", "It answered without calling any tool."
        from keel.diagnostics.errors import classify_failure

        record = classify_failure(traj, task, self.env.store)
        category, hop = record["category"], record["hop"]
        if category == "relation_selection" and hop is not None:
            h, r, t = task.gold_triples[hop]
            for step in traj.steps:
                args = step.call.arguments if isinstance(step.call.arguments, dict) else {}
                if step.call.name in ENTITY_VERBS and self._entity_id(args.get("entity")) in (h, t) and args.get("relation") != r:
                    return step.turn, "wrong_relation", f"From {self._entity_id(args.get('entity'))} it followed {_clip(args.get('relation'))}; the gold path follows {r}."
            return last, "wrong_relation", f"It never followed {r} (hop {hop + 1} of the gold path)."
        if category == "composition" and hop is not None:
            h, r, t = task.gold_triples[hop]
            for step in traj.steps:
                args = step.call.arguments if isinstance(step.call.arguments, dict) else {}
                if step.call.name in ENTITY_VERBS and args.get("relation") == r and self._entity_id(args.get("entity")) not in (h, t):
                    return step.turn, "wrong_entity", f"It followed {r} from {_clip(args.get('entity'))}; the gold path follows it from {h}."
            return last, "missing_call", f"It answered before querying {h if hop else next(iter(task.topic_entities), h)} (hop {hop + 1} of the gold path)."
        gold = task.answers[0] if task.answers else ""
        return last, "wrong_answer", f"It answered {_clip(traj.answer)!s}; the answer is {gold}."

    def _kg_step(self, step: Step, required, gold_pairs, gold_entities, relations_of, gold_relations) -> tuple[str, str] | None:
        call, obs = step.call, step.observation
        args = call.arguments if isinstance(call.arguments, dict) else {}
        if call.error is not None:
            return "format_error", f"The call could not be parsed ({call.error}): {_clip(call.raw)}"
        if obs.error == "unknown_tool":
            return "unknown_function", f"{_clip(call.name)!r} is not a tool; the tools are {', '.join(required)}."
        if obs.error == "bad_arguments":
            need = required.get(call.name, ())
            missing = [k for k in need if k not in args]
            if missing:
                return "missing_parameter", f"{call.name} was called without {', '.join(missing)}."
            return "wrong_arguments", f"{call.name} takes ({', '.join(need)}), got ({', '.join(sorted(map(str, args)))})."
        entity = self._entity_id(args.get("entity"))
        relation = str(args.get("relation", ""))
        if obs.error == "unknown_entity":
            expected = self._expected_entity(relation, gold_pairs)
            return "wrong_entity", f"{_clip(args.get('entity'))} is not an entity of the graph" + (f"; the gold call uses {expected}." if expected else ".")
        if obs.error == "unknown_relation":
            expected = relations_of.get(entity)
            return "wrong_relation", f"{_clip(relation)} is not a relation of the graph" + (f"; from {entity} the gold path follows {expected[0]}." if expected else ".")
        if obs.ok and not is_empty_observation(obs.result_text):
            return None
        # an executed query that returned nothing: which argument is off the gold path?
        if call.name in ENTITY_VERBS:
            on_path_entity = entity in gold_entities
            if on_path_entity and relation not in relations_of.get(entity, []) and relations_of.get(entity):
                return "wrong_relation", f"{call.name}({entity}, {_clip(relation)}) returned nothing; from {entity} the gold path follows {relations_of[entity][0]}."
            if relation in gold_relations and not on_path_entity:
                expected = self._expected_entity(relation, gold_pairs)
                return "wrong_entity", f"{call.name}({_clip(args.get('entity'))}, {relation}) returned nothing; the gold call uses {expected or 'another entity'}."
            for verb, e, r in gold_pairs:
                if e == entity and r == relation and verb != call.name:
                    return "wrong_function", f"{call.name}({entity}, {relation}) returned nothing; the gold call is {verb}."
        return "empty_result", f"{call.name}({_clip(', '.join(str(v) for v in args.values()))}) returned nothing."

    @staticmethod
    def _expected_entity(relation: str, gold_pairs) -> str:
        """The entity the gold uses with `relation` (else the first gold entity)."""
        for _v, e, r in gold_pairs:
            if r == relation:
                return e
        return gold_pairs[0][1] if gold_pairs else ""

    # -- function calling -------------------------------------------------------------------------
    def _function_calling(self, traj: Trajectory, task: Task) -> tuple[int, str, str]:
        # Assistant turn a answers user turn user_of[a]: a turn without calls closes a user turn.
        with_steps = {s.turn for s in traj.steps}
        user_of, k = [], 0
        for a in range(len(traj.turn_texts)):
            user_of.append(k)
            if a not in with_steps:
                k += 1
        required = _required(self.env, task)
        soft: tuple[int, str, str] | None = None  # an extra call, reported only if nothing worse is found
        for k, gold in enumerate(task.gold_turns):
            turns = [a for a, u in enumerate(user_of) if u == k]
            if not turns:
                last = len(traj.turn_texts) - 1
                return last, "missing_call", f"The episode ended before user turn {k + 1} (after {len(traj.turn_texts)} assistant turns)."
            steps = [s for s in traj.steps if s.turn in turns]
            pending = list(gold)
            for step in steps:
                hard, extra = self._fc_step(step, pending, required, k)
                if hard is not None:
                    return step.turn, hard[0], hard[1]
                if extra is not None and soft is None:
                    soft = (step.turn, extra[0], extra[1])
            if pending:
                c = pending[0]
                return turns[-1], "missing_call", f"User turn {k + 1} ended without {show_call(c, self.call_format)}."
        if soft is not None:
            return soft
        err = traj.info.get("checker_error_type") or "the final state differs from the gold"
        return len(traj.turn_texts) - 1, "wrong_answer", f"Every gold call was made, but BFCL's checker failed ({_clip(err)})."

    def _fc_step(self, step: Step, pending: list[dict[str, Any]], required, k: int):
        """(hard cause, extra-call cause) of one call; matched gold calls are removed from `pending`."""
        call, obs = step.call, step.observation
        if call.error is not None:
            return ("format_error", f"The call could not be parsed ({call.error}): {_clip(call.raw)}"), None
        if obs.error == "unknown_tool" or (required and call.name not in required):
            # BFCL runs any method of the entry's classes; a function the task does not offer is still wrong
            return ("unknown_function", f"{_clip(call.name)!r} is not one of the offered functions ({', '.join(required)})."), None
        args = call.arguments if isinstance(call.arguments, dict) else {}
        same_name = [c for c in pending if c["name"] == call.name]
        exact = [c for c in same_name if c["arguments"] == args]
        if exact:
            if not obs.ok:
                return ("execution_error", f"{call.name} failed: {_clip(obs.text)}"), None
            pending.remove(exact[0])
            return None, None
        if same_name:
            gold = same_name[0]
            missing = [p for p in gold["arguments"] if p not in args]
            if missing:
                return ("missing_parameter", f"{call.name} was called without {', '.join(missing)}; the correct call is {show_call(gold, self.call_format)}."), None
            wrong = [p for p in gold["arguments"] if args.get(p) != gold["arguments"][p]] + [p for p in args if p not in gold["arguments"]]
            return ("wrong_arguments", f"{call.name} got {', '.join(f'{p}={_clip(json.dumps(args.get(p)), 40)}' for p in wrong)}; the correct call is {show_call(gold, self.call_format)}."), None
        if obs.error in ("bad_arguments", "argument_out_of_range"):
            need = required.get(call.name, ())
            missing = [p for p in need if p not in args]
            if missing:
                return ("missing_parameter", f"{call.name} was called without {', '.join(missing)}."), None
            return ("wrong_arguments", f"{call.name}: {_clip(obs.text)}"), None
        if obs.error is not None or not obs.ok:
            return ("execution_error", f"{call.name} failed: {_clip(obs.text)}"), None
        if pending:
            return ("wrong_function", f"It called {call.name}; the correct call is {show_call(pending[0], self.call_format)}."), None
        return None, ("extra_call", f"User turn {k + 1} needed no call to {call.name}.")


# --- the LLM analyzer --------------------------------------------------------------------------------

ANALYZER_INSTRUCTIONS = (
    "You analyse a failed tool-use episode against its correct solution. Reply in exactly this form:\n"
    "Turn N went wrong: CAUSE. One or two sentences on why.\n"
    "Corrected calls:\n"
    "Turn 1: {\"name\": ..., \"arguments\": {...}}\n"
    "...\n"
    "N counts the assistant turns of the episode from 1. CAUSE is one of: " + ", ".join(CAUSES.values()) + "."
)
_TURN_RE = re.compile(r"Turn\s+(\d+)\s+went wrong:\s*([A-Za-z ]+?)\s*(?:\.|$)", re.MULTILINE)


def render_episode(traj: Trajectory, task: Task, limit: int = 600) -> str:
    """The episode as plain text for an LLM analyzer: each assistant turn, then its tool results."""
    lines = [f"Question: {task.question}"]
    for a, text in enumerate(traj.turn_texts):
        lines.append(f"Assistant turn {a + 1}:\n{text.strip()}")
        results = [s.observation.text for s in traj.steps if s.turn == a]
        if results:
            lines.append("Tool results:\n" + "\n".join(_clip(r, limit) for r in results))
    lines.append(f"Final answer: {traj.answer}" if traj.answer is not None else "Final answer: (none)")
    return "\n".join(lines)


class LLMAnalyzer:
    """Reflections from an OpenAI-compatible endpoint (keel.endpoint.chat). Endpoint failures
    raise keel.endpoint.EndpointError; `collect_reflections` counts them instead of stopping."""

    name = "llm"

    def __init__(self, base_url: str, model: str, api_key: str | None = None, call_format: str = "json",
                 temperature: float = 0.0, max_tokens: int = 512, timeout: float = 60) -> None:
        from keel.endpoint import completions_url

        completions_url(base_url)  # a bad URL fails at construction
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.call_format = call_format
        self.temperature, self.max_tokens, self.timeout = temperature, max_tokens, timeout

    def messages(self, traj: Trajectory, task: Task) -> list[dict[str, str]]:
        user = f"{render_episode(traj, task)}\n\nCorrect solution:\n{corrected_calls_text(task, self.call_format)}"
        return [{"role": "system", "content": ANALYZER_INSTRUCTIONS}, {"role": "user", "content": user}]

    def analyze(self, traj: Trajectory, task: Task) -> Reflection | None:
        from keel.endpoint import EndpointError, chat, completions_url

        if succeeded(traj, task):
            return None
        text = chat(self.base_url, self.model, self.messages(traj, task), api_key=self.api_key, timeout=self.timeout,
                    temperature=self.temperature, max_tokens=self.max_tokens).strip()
        if not text:
            raise EndpointError(f"{completions_url(self.base_url)}: the analyzer returned an empty reflection")
        turn, cause, detail = -1, "unparsed", ""
        m = _TURN_RE.search(text)
        if m:
            turn = int(m.group(1)) - 1
            phrase = m.group(2).strip().lower()
            cause = next((k for k, v in CAUSES.items() if v == phrase), "unparsed")
            detail = text[m.end():].split("\n", 1)[0].strip()
        return Reflection(task.id, turn, cause, detail, text, [list(t) for t in task.gold_turns])


def collect_reflections(analyzer, trajs: Sequence[Trajectory], tasks_by_id: dict[str, Task], fail_at: float = 0.0,
                        max_count: int | None = None) -> tuple[list[tuple[Trajectory, Reflection]], int]:
    """Reflections on the failed trajectories (reward ≤ fail_at), in order, at most `max_count`.

    Returns ([(trajectory, reflection)], endpoint errors). An endpoint failure skips that
    trajectory (counted), so a flaky analyzer slows supervision down instead of stopping a run.
    """
    from keel.endpoint import EndpointError

    out: list[tuple[Trajectory, Reflection]] = []
    errors = 0
    for traj in trajs:
        if max_count is not None and len(out) >= max_count:
            break
        if traj.reward > fail_at:
            continue
        task = tasks_by_id.get(traj.task_id)
        if task is None:
            raise ValueError(f"collect_reflections: trajectory for task {traj.task_id!r} has no task among the {len(tasks_by_id)} given")
        try:
            r = analyzer.analyze(traj, task)
        except EndpointError:
            errors += 1
            continue
        if r is not None:
            out.append((traj, r))
    return out, errors


# --- the training example ----------------------------------------------------------------------------


def reflection_trajectory(tokenizer, traj: Trajectory, reflection_text: str) -> Trajectory:
    """The trajectory (hints removed, an unfinished last turn closed with <|im_end|>), a user turn
    asking for reflection, then the reflection as an assistant turn sourced REFLECTION.

    Worked example (ids abbreviated): [p p | a a E | t t | a E] + [request r r r] + [x x x E]
    with sources [0 0 | 1 1 1 | 2 2 | 1 1] + [0 0 0 0] + [5 5 5 5]; turn_spans = [the x-span].
    """
    from keel.signals.hints import strip_hints

    if not isinstance(reflection_text, str) or not reflection_text.strip():
        raise ValueError(f"reflection_example: empty reflection text for task {traj.task_id!r}")
    if not traj.token_ids:
        raise ValueError(f"reflection_example: trajectory for task {traj.task_id!r} has no tokens (a text-policy episode?)")
    base = strip_hints(traj)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    ids, sources = list(base.token_ids), list(base.sources)
    if ids[-1] != eos:  # cut at a token limit mid-turn: close it so the request starts a new turn
        ids.append(eos)
        sources.append(int(Source.PROMPT))
    request = tokenizer.encode(render_user_turn(REFLECTION_REQUEST), add_special_tokens=False)
    target = tokenizer.encode(reflection_text.strip(), add_special_tokens=False) + [eos]
    ids += request
    sources += [int(Source.PROMPT)] * len(request)
    start = len(ids)
    ids += target
    sources += [int(Source.REFLECTION)] * len(target)
    return Trajectory(task_id=traj.task_id, token_ids=ids, sources=sources, logprobs=[0.0] * len(ids), turn_spans=[(start, len(ids))],
                      turn_texts=[reflection_text.strip()], info={"reflection": True})


def reflection_example(tokenizer, traj: Trajectory, reflection_text: str, max_tokens: int | None = None) -> SFTExample | None:
    """An SFT example whose targets are the reflection tokens only (the trajectory is context).
    None when it would be longer than `max_tokens`."""
    tr = reflection_trajectory(tokenizer, traj, reflection_text)
    if max_tokens is not None and len(tr.token_ids) > max_tokens:
        return None
    (example,) = decompose(tr, target_sources=(Source.REFLECTION,))
    return example


class PRS(Signal):
    """`signals.reflection`: an analyzer reflects on failed episodes (visited in an order drawn
    from the run's rng); the newest `signals.reflection.pool` reflection examples are the
    supervision kind "reflection". The pool is its checkpointed state (reflections.pt)."""

    name, kind = "reflections", "reflection"

    def __init__(self, cfg: SignalsConfig, ctx: SignalContext):
        super().__init__(cfg, ctx)
        r = cfg.reflection
        self.analyzer = RuleAnalyzer(ctx.env) if r.analyzer == "rule" else LLMAnalyzer(r.base_url, r.model, r.api_key or None,
                                                                                         env_call_format(ctx.env))
        self.examples: list[SFTExample] = []  # newest last

    @staticmethod
    def enabled(cfg: SignalsConfig) -> bool:
        return cfg.reflection.enabled

    def reflect(self, trajs, rng):
        r = self.cfg.reflection
        got, errors = collect_reflections(self.analyzer, rng.sample(trajs, len(trajs)), self.ctx.tasks_by_id, r.fail_at, r.per_step)
        self.examples.extend(e for e in (reflection_example(self.ctx.tokenizer, tr, x.text, r.max_tokens) for tr, x in got) if e is not None)
        del self.examples[: -r.pool]
        return {M.SIGNAL_REFLECTIONS: float(len(got)), M.SIGNAL_REFLECTION_ERRORS: float(errors)}

    def pool(self) -> list[SFTExample]:
        return list(self.examples)

    def state_dict(self) -> list:
        """[(token_ids, sources, task_id, turn), ...], oldest first."""
        return [(e.token_ids, e.sources, e.task_id, e.turn) for e in self.examples]

    def load_state_dict(self, state: list) -> None:
        self.examples = [SFTExample(*_with_sources(row)) for row in state]


def _with_sources(row: list) -> list:
    """A saved reflection row; rows saved before SFT rows carried sources held target flags
    (True → REFLECTION, False → PROMPT, the same loss)."""
    ids, marks, *rest = row
    if all(isinstance(m, bool) for m in marks):
        marks = [int(Source.REFLECTION) if m else int(Source.PROMPT) for m in marks]
    return [ids, marks, *rest]
