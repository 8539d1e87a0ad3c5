"""Paper B's reward ladder (rungs 1–6) and paper A's function-calling rewards, as plain functions.

Paper B climbs from an outcome reward (0.5·EM + 0.5·F1) through process rewards (stepwise,
tool-verb weights) to a self-verifying reward (R-selfV); each rung produced its own failure
mode. Paper A scores a BFCL trajectory 1 if the multi-turn checker accepts it.

Contract: `fn(traj, task) -> (total, components)`. Every component is returned so that the
trainer can log it as `reward/<component>`. `REWARDS` maps the config name of a reward to its
function; adding a reward is adding one entry. Your own reward is `reward.name:
module:function` (or `path/to/file.py:function`) with the same contract (`resolve_reward`):
`traj` is the episode (`traj.answer` the final answer, `traj.steps` the calls with their
observations, `traj.turn_texts` the assistant texts), `task` the task (`task.answers`, and for
`data.source: jsonl` every extra field of its line in `task.meta["fields"]`). For any task:
`answer_em`, `answer_f1` (against the task's `answer`) and `calls_succeeded`.

Where Keel departs from the authors' released reward module (`PAPERS.md`, "How the authors'
code computes the pieces"):
- Steps are read from `traj.steps` (parsed calls with their observations), not re-parsed from
  the flat output text; the answer is `traj.answer`, set by the rollout with
  `keel.chat.extract_answer`: their rule (the first `<answer>…</answer>`, else the text after
  the last `</think>`), applied to the final turn rather than to the whole output; an episode
  that never answered scores as an empty answer.
- Rewards read what the tool returned (`Observation.result_text`), not what the model was
  shown: the oracle-relations ablation appends a hint to the shown text, and "[]\nHint: …"
  must still be an empty result, its entities the same as without the hint.
- One empty-observation rule everywhere (blank, exactly `[]`, "No results found", or starting
  with "ERROR"). Their tool-verb weight did not treat "ERROR…" as empty; Keel does, so that
  the informative-error switch (L_sig) changes what the model reads but not what it is paid.
- Keel's KG observations list entities as `"Name (m.id)"`: the trailing ` (m.id)` is stripped
  when returned entities are read, otherwise no entity could ever be a substring of an answer.
- R-stepwise reads "observation words" as whitespace tokens with list punctuation (`[]"'(),`)
  stripped, plus each whole returned entry (its name and its id). The authors' words were,
  for on_path, whitespace tokens with that punctuation attached and, for progress and
  coherence, the tokens of the normalised text (ids split on "."), so a Freebase id printed
  by Keel's env could never count as a word and chaining an id across turns could never earn
  coherence. `r_stepwise_released` is the rung with their words, to run rung 3 as the paper
  ran it; its docstring gives the measured size of the difference.
- The ≥2-distinct gate of R-selfV is a working gate (see `r_selfv_gated`), and counts calls
  as the env executed them (`call_key`), not as the model spelled them.
"""

from __future__ import annotations

import re
from typing import Callable

from keel.answers import exact_match, f1_score, normalise
from keel.errors import UserError
from keel.kg.base import ENTITY_VERBS, RELATION_VERBS
from keel.types import Step, Task, Trajectory

RewardFn = Callable[[Trajectory, Task], tuple[float, dict[str, float]]]

# R-toolverbs weights (authors' code; their notes list different ones): retrieving entities is
# worth more than listing relations, which never returns [] for a known entity.
VERB_WEIGHTS = {**dict.fromkeys(ENTITY_VERBS, 1.0), **dict.fromkeys(RELATION_VERBS, 0.3)}
# R-stepwise per-step weights: on_path, progress, coherence, valid.
STEP_WEIGHTS = {"on_path": 0.45, "progress": 0.30, "coherence": 0.15, "valid": 0.10}
VALID_MIN_CHARS = 10  # "valid" = the observation text is longer than 10 characters (theirs)
GATE_MIN_DISTINCT = 2  # R-selfV gate: distinct non-empty calls needed before r_retrv counts

_EMPTY_TEXTS = ("", "[]", "No results found")
_TRAILING_ID = re.compile(r"\s*\([^()\s]*\)\s*$")  # " (m.0d3k14)" at the end of an entry
_NOT_SHOWN = re.compile(r"\s*\(\d+ more not shown\)\s*$")  # keel.kg.env's note after a list cut at env.max_items
_WORD_PUNCT = "[]\"'(),"


# --- pieces shared by several rungs (and by keel.diagnostics) -----------------------------------


def is_empty_observation(text: str | None) -> bool:
    """Paper B's empty rule: blank, exactly `[]`, "No results found", or starts with "ERROR".

    >>> [is_empty_observation(t) for t in ["[]", " ", "ERROR: unknown entity", '["Paris (m.05qtj)"]']]
    [True, True, True, False]
    """
    s = (text or "").strip()
    return s in _EMPTY_TEXTS or s.startswith("ERROR")


def returned_entities(text: str | None) -> list[str]:
    """Entries of a non-empty observation, read as the authors read them: strip `[]` from the
    ends, split on commas, strip spaces and quotes; Keel also strips a trailing ` (m.id)`.

    A name containing a comma is split in two, as in their code. Keel's note after a list cut at
    `env.max_items` ("(12 more not shown)") is not an entry.
    >>> returned_entities('["Barack Obama (m.02mjmr)", "Honolulu (m.03h64)"]')
    ['Barack Obama', 'Honolulu']
    """
    if is_empty_observation(text):
        return []
    out = []
    for part in _NOT_SHOWN.sub("", text).strip().strip("[]").split(","):
        entry = _TRAILING_ID.sub("", part.strip().strip('"').strip("'")).strip()
        if entry:
            out.append(entry)
    return out


def observation_words(text: str | None) -> set[str]:
    """Lowercased words of an observation for R-stepwise: whitespace tokens with list
    punctuation stripped, plus every whole entry and every id in parentheses.

    >>> sorted(observation_words('["Barack Obama (m.02mjmr)"]'))
    ['barack', 'barack obama', 'm.02mjmr', 'obama']
    """
    low = _NOT_SHOWN.sub("", text or "").lower()
    words = {w.strip(_WORD_PUNCT) for w in low.split()}
    for part in low.strip().strip("[]").split(","):
        entry = part.strip().strip('"').strip("'").strip()
        m = _TRAILING_ID.search(entry)
        if m:
            words.add(m.group(0).strip().strip("()"))
            entry = entry[: m.start()].strip()
        words.add(entry)
    words.discard("")
    return words


def call_arguments(step: Step) -> set[str]:
    """The call's string argument values, lowercased and stripped of quotes (the authors'
    `_parse_action` args). A call that did not parse has none."""
    out = set()
    for v in step.call.arguments.values():
        if isinstance(v, str) and v.strip():
            out.add(v.strip().strip("'\"").lower())
    return out


def call_key(step: Step) -> tuple[str, ...] | str:
    """What makes two calls the same call: the call the env executed (`Observation.resolved`,
    e.g. (verb, entity id, relation)), so that `m.1`, `" m.1"` and `"Name (m.1)"` are one call;
    the raw (verb, arguments) signature only where the observation carries no resolution (a
    trajectory saved before it existed, a call that never reached the backend)."""
    resolved = step.observation.resolved
    return tuple(resolved) if resolved is not None else step.call.signature()


def distinct_nonempty_calls(steps: list[Step]) -> int:
    """Number of distinct calls (`call_key`) among calls with a non-empty result. Re-issuing
    the same call, in the same or another spelling, does not count twice."""
    return len({call_key(s) for s in steps if not is_empty_observation(s.observation.result_text)})


def answer_text(traj: Trajectory) -> str:
    """The episode's answer, "" when it never answered."""
    return traj.answer or ""


def outcome(traj: Trajectory, task: Task) -> dict[str, float]:
    """EM (any answer or alias), F1 (primary answer) and r_out = 0.5·EM + 0.5·F1."""
    answer = answer_text(traj)
    em = exact_match(answer, list(task.answers) + list(task.aliases))
    f1 = f1_score(answer, task.answers[0]) if task.answers else 0.0
    return {"em": em, "f1": f1, "r_out": 0.5 * em + 0.5 * f1}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# --- rungs 1–2: outcome only ----------------------------------------------------------------------


def r_binary(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Rung 1, R-binary: r_out = 0.5·EM + 0.5·F1 of the answer."""
    out = outcome(traj, task)
    return out["r_out"], out


def r_binary_sr(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Rung 2, R-binary-SR (Search-R1 recipe): EM only. F1 is logged but not paid."""
    out = outcome(traj, task)
    return out["em"], out


# --- rung 3: stepwise process reward -------------------------------------------------------------


def stepwise_step_scores(traj: Trajectory, task: Task, released: bool = False) -> list[dict[str, float]]:
    """Per step: on_path, progress, coherence, valid (each in [0, 1]) and their weighted sum.

    - on_path: 1 if some gold triple (h, r, t) has both h and t (lowercased) as substrings of
      the lowercased observation text; else min(#gold-path entities among the observation
      words / #gold-path entities, 0.5).
    - progress: 1 if a gold answer entity (answer ids, answers, aliases, lowercased) is one of
      the call's arguments or observation words; else min(#gold-path entities among the
      observation words / #gold-path entities, 1).
    - coherence: 1 if the call's arguments share an entity with the previous step's arguments
      and observation words (for the first step: the topic entities' ids and names).
    - valid: 1 if the observation text is longer than 10 characters.
    Without gold triples on_path is 0 and progress falls back to answer matches only (theirs).

    "Observation words" are Keel's (`observation_words`) by default. With `released`, they are
    the authors': for on_path the lowercased whitespace tokens with punctuation attached, for
    progress and coherence the tokens of the normalised text (every non-word character a
    space, so `m.0abc` becomes `m`, `0abc`). The observation is the tool's own output
    (`Observation.result_text`), never an oracle hint.
    """
    triples = [(str(h).lower(), str(t).lower()) for h, _r, t in task.gold_triples]
    path_entities = {e for pair in triples for e in pair}
    answer_entities = {a.lower() for a in list(task.answer_ids) + list(task.answers) + list(task.aliases) if a}
    previous = {str(k).lower() for k in task.topic_entities} | {str(v).lower() for v in task.topic_entities.values()}
    scores = []
    for step in traj.steps:
        text = step.observation.result_text or ""
        low = text.lower()
        args = call_arguments(step)
        if released:
            path_words, words = set(low.split()), set(normalise(text).split())
        else:
            path_words = words = observation_words(text)
        on_path = 0.0
        if triples and text:
            if any(h in low and t in low for h, t in triples):
                on_path = 1.0
            elif path_hits := len(path_entities & path_words):
                on_path = min(path_hits / len(path_entities), 0.5)
        progress = 0.0
        if answer_entities:
            if (args | words) & answer_entities:
                progress = 1.0
            elif path_entities:
                progress = min(len(path_entities & words) / len(path_entities), 1.0)
        coherence = 1.0 if previous and args and (previous & args) else 0.0
        valid = 1.0 if len(text.strip()) > VALID_MIN_CHARS else 0.0
        parts = {"on_path": on_path, "progress": progress, "coherence": coherence, "valid": valid}
        parts["step"] = sum(STEP_WEIGHTS[k] * parts[k] for k in STEP_WEIGHTS)
        scores.append(parts)
        previous = args | words
    return scores


def _stepwise(traj: Trajectory, task: Task, released: bool) -> tuple[float, dict[str, float]]:
    out = outcome(traj, task)
    scores = stepwise_step_scores(traj, task, released)
    for k in ("on_path", "progress", "coherence", "valid"):
        out[k] = _mean([s[k] for s in scores])
    out["r_step"] = _mean([s["step"] for s in scores])
    total = 0.3 * out["r_out"] + 0.7 * out["r_step"]
    return total, out


def r_stepwise(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Rung 3, R-stepwise: 0.3·r_out + 0.7·mean over steps of
    (0.45·on_path + 0.30·progress + 0.15·coherence + 0.10·valid); the step mean is 0 without steps.

    Keel's word rule (`observation_words`), under which an id shown by the env is a word; see
    `r_stepwise_released` for the rule paper B ran and how far apart the two are."""
    return _stepwise(traj, task, released=False)


def r_stepwise_released(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Rung 3 as paper B ran it: `r_stepwise` with the authors' observation words
    (`stepwise_step_scores(..., released=True)`).

    Under it an id in Keel's `"Name (m.id)"` entries is never a word ('(m.id)"]' for on_path;
    `m`, `id` for progress and coherence), so partial on_path never pays, progress pays only
    for an answer whose name is one word (or an answer id passed as an argument), and carrying an id from one
    observation into the next call never earns coherence.

    Size of the departure, measured with `scripts/stepwise_rule_gap.py` (synthetic KG seed 0,
    paper B's interface, episodes played through KGEnv and scored by both rules): Keel's rule
    never scores an episode lower, and scores it higher in
    - 310 of 400 episodes (77.5%) of a policy mixing gold, perturbed-gold and random calls, by
      +0.132 total (+0.188 r_step) on those, at most +0.368 total;
    - 184 of 400 (46.0%) of random calls only, by +0.042 total (+0.060 r_step), nearly all
      through coherence (176 episodes; on_path and progress 14 each);
    - 100 of 100 of the oracle's gold walks on dev, by +0.154 total: r_step 0.470 against
      0.251. Under the released rule the gold path earns about what the ritual of rung 3 earns
      (one relation call on the topic entity: 0.25 per step under both rules).

    Both rules read the answer as the released code does: the first `<answer>…</answer>`
    (`keel.chat.extract_answer`), so r_out is the same under both; what is still Keel's here,
    as in every rung: the tag is read in the final turn rather than the whole output, steps
    come from `traj.steps` (parsed JSON calls, their string arguments) rather than
    `name(a, b)` text, and the first step's coherence reads the topic entities' ids and names.
    """
    return _stepwise(traj, task, released=True)


# --- rung 4: tool-verb weights -------------------------------------------------------------------


def tool_verb_score(steps: list[Step]) -> float:
    """mean over steps of w: 1.0 entity verb, 0.3 relation verb, 0 other verbs or an empty
    observation; 0 with no steps."""
    return _mean([0.0 if is_empty_observation(s.observation.result_text) else VERB_WEIGHTS.get(s.call.name, 0.0) for s in steps])


def r_toolverbs(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Rung 4, R-toolverbs: 0.3·r_out + 0.7·r_tool (`tool_verb_score`). Rung 5 is the same
    reward with the KL coefficient ×5 (a config change, not a reward)."""
    out = outcome(traj, task)
    out["r_tool"] = tool_verb_score(traj.steps)
    return 0.3 * out["r_out"] + 0.7 * out["r_tool"], out


# --- rung 6: self-verifying reward ---------------------------------------------------------------


def retrieval_contribution(steps: list[Step], answer: str) -> float:
    """r_retrv: productive calls / all calls. A call is productive when its observation is
    non-empty and some returned entity, normalised, is a substring of the normalised answer.
    0 with no steps or an empty answer."""
    norm_answer = normalise(answer)
    if not steps or not norm_answer:
        return 0.0
    productive = 0
    for s in steps:
        if any((e := normalise(ent)) and e in norm_answer for ent in returned_entities(s.observation.result_text)):
            productive += 1
    return productive / len(steps)


def _selfv(traj: Trajectory, task: Task, retrieval: str) -> tuple[float, dict[str, float]]:
    out = outcome(traj, task)
    out["r_tool"] = tool_verb_score(traj.steps)
    out["r_retrv_raw"] = retrieval_contribution(traj.steps, answer_text(traj))
    out["distinct_nonempty"] = float(distinct_nonempty_calls(traj.steps))
    out["gate_open"] = 1.0 if out["distinct_nonempty"] >= GATE_MIN_DISTINCT else 0.0
    if retrieval == "plain":
        out["r_retrv"] = out["r_retrv_raw"]
    elif retrieval == "gated":
        out["r_retrv"] = out["r_retrv_raw"] * out["gate_open"]
    else:  # "off"
        out["r_retrv"] = 0.0
    total = 0.25 * out["r_out"] + 0.50 * out["r_tool"] + 0.25 * out["r_retrv"]
    return total, out


def r_selfv(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Rung 6, R-selfV: 0.25·r_out + 0.50·r_tool + 0.25·r_retrv.

    The reward that produced paper B's cliff: one call whose first returned entity is copied
    into <answer> earns r_retrv = 1 ("quote and stop")."""
    return _selfv(traj, task, "plain")


def r_selfv_gated(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """R-selfV with r_retrv counted only when the episode made ≥2 distinct non-empty calls
    (distinct = a different call as the env executed it, `call_key`: (verb, resolved entity,
    resolved relation), so that one call spelled `m.1` and `"Name (m.1)"` — quote and stop,
    written twice — keeps the gate shut; the raw (verb, arguments) signature only for
    observations that carry no resolution, e.g. trajectories saved before Keel recorded it).

    This is the gate *as described* in paper B. The released gate was degenerate: it read
    signature fields that its step parser never filled, so every signature was equal, the gate
    never opened and r_retrv was always 0 (70 of 300 random trajectories had r_retrv > 0
    without the gate, 0 with it). The paper's "gate prevented the cliff" therefore tested
    `r_selfv_no_retrv`; whether this working gate prevents it is an open question.
    """
    return _selfv(traj, task, "gated")


def r_selfv_no_retrv(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """R-selfV with r_retrv switched off (what the released gate actually ran):
    0.25·r_out + 0.50·r_tool; `r_retrv_raw` is still logged."""
    return _selfv(traj, task, "off")


# --- paper A: function calling -------------------------------------------------------------------


def _checker_valid(traj: Trajectory) -> float:
    valid = traj.info.get("checker_valid")
    if not isinstance(valid, bool):
        raise ValueError(
            f"fc reward: trajectory {traj.task_id!r} has info['checker_valid']={valid!r}; "
            "the function-calling env must store the multi-turn checker's verdict there as a bool"
        )
    return 1.0 if valid else 0.0


def fc_binary(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Paper A's reward: 1 iff BFCL's multi-turn checker said the trajectory is valid."""
    valid = _checker_valid(traj)
    return valid, {"valid": valid}


def tool_call_tag_counts(text: str) -> tuple[int, int]:
    """(#"<tool_call>", #"</tool_call>") in a text ("<tool_call>" is not inside "</tool_call>")."""
    return text.count("<tool_call>"), text.count("</tool_call>")


def tag_imbalance(text: str) -> float:
    """|#<tool_call> − #</tool_call>| / (#<tool_call> + #</tool_call>); 0 without tags."""
    n_open, n_close = tool_call_tag_counts(text)
    return abs(n_open - n_close) / (n_open + n_close) if n_open + n_close else 0.0


def fc_tag_balance(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Paper A's unused variant: valid − |#<tool_call> − #</tool_call>| / (sum of both), over all
    assistant text; no tags, no penalty. Can be negative (invalid and unbalanced)."""
    valid = _checker_valid(traj)
    imbalance = tag_imbalance(traj.text)
    return valid - imbalance, {"valid": valid, "tag_imbalance": imbalance}


# --- any task (env.kind tools / mcp, or any other) ------------------------------------------------


def answer_em(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Exact match of the final answer against `answer` (any accepted string; normalised as
    paper B's code does, `keel.answers`). F1 is logged, not paid."""
    out = outcome(traj, task)
    return out["em"], {"em": out["em"], "f1": out["f1"]}


def answer_f1(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """Token F1 of the final answer against the primary `answer`. EM is logged, not paid."""
    out = outcome(traj, task)
    return out["f1"], {"em": out["em"], "f1": out["f1"]}


def calls_succeeded(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
    """1 when the episode made at least one call and every call succeeded (`Observation.ok`),
    else 0. An episode without any call scores 0, so not calling is not "every call succeeded".

    Worked example: 3 calls, one answered `Error: ValueError: ...` → 0 (calls 3, failed 1).
    """
    n = len(traj.steps)
    failed = sum(1 for s in traj.steps if not s.observation.ok)
    total = 1.0 if n and not failed else 0.0
    return total, {"calls_succeeded": total, "calls": float(n), "failed_calls": float(failed)}


REWARDS: dict[str, RewardFn] = {
    "r_binary": r_binary,
    "r_binary_sr": r_binary_sr,
    "r_stepwise": r_stepwise,
    "r_stepwise_released": r_stepwise_released,
    "r_toolverbs": r_toolverbs,
    "r_selfv": r_selfv,
    "r_selfv_gated": r_selfv_gated,
    "r_selfv_no_retrv": r_selfv_no_retrv,
    "fc_binary": fc_binary,
    "fc_tag_balance": fc_tag_balance,
    "answer_em": answer_em,
    "answer_f1": answer_f1,
    "calls_succeeded": calls_succeeded,
}


def score(trajs: list[Trajectory], tasks: list[Task], reward_fn: RewardFn) -> None:
    """Set each trajectory's reward and components. A reward function that raises gives 0.0 and
    the component reward_error = 1, the error kept in `info` (one odd sample must not crash a long run)."""
    for tr, task in zip(trajs, tasks):
        try:
            total, parts = reward_fn(tr, task)
        except Exception as exc:
            total, parts = 0.0, {"reward_error": 1.0}
            tr.info["reward_error"] = f"{type(exc).__name__}: {exc}"
        tr.reward, tr.reward_components = float(total), parts


def resolve_reward(name: str) -> RewardFn:
    """A key of REWARDS, or the user's `module:function` / `path/to/file.py:function`.

    The user's function keeps the contract: `fn(trajectory, task) -> (total, components)`, total
    a number, components a dict of numbers (each logged as `reward/<name>`); it is checked on
    every call (`checked_reward`), so a wrong return type is a one-line error naming the
    function instead of a crash deep inside the update.
    """
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise UserError(f"reward.name: unknown reward {name!r} (known: {', '.join(sorted(REWARDS))}; or module:function)")
    from keel.tools.python import ToolLoadError, load_callable

    try:
        fn = load_callable(name, "reward.name")
    except ToolLoadError as e:
        raise UserError(str(e)) from None
    return checked_reward(fn, name)


def checked_reward(fn: RewardFn, name: str) -> RewardFn:
    def reward(traj: Trajectory, task: Task) -> tuple[float, dict[str, float]]:
        out = fn(traj, task)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (int, float)) and not isinstance(out[0], bool)
                and isinstance(out[1], dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in out[1].values())):
            raise UserError(f"reward {name} returned {type(out).__name__} {str(out)[:80]!r}; expected (total, {{component: number}})")
        return float(out[0]), {str(k): float(v) for k, v in out[1].items()}

    reward.__name__ = getattr(fn, "__name__", name)
    return reward
