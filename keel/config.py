"""One typed config tree. Every field is documented once, here (`keel train --help-config` prints it).

Presets in configs/ are small YAML diffs from these defaults. Overrides `--set a.b=value` are
parsed as YAML scalars and type-checked against the field; an unknown key or a wrong type is a
one-line error naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from keel.errors import UserError



class ConfigError(UserError):
    """A bad config: unknown key, wrong type, unreadable preset. The message is one line."""


def doc(default, help: str):
    """A field with its one-line documentation, the one way every field of the tree is declared
    (`describe` prints it). A mutable default (a list, a dict, a section) is copied per instance."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = doc("smollm2", "'smollm2' (embedded SmolLM2-135M-Instruct), 'tiny' (random, for tests) or a local HF model directory")
    dtype: str = doc("float32", "weights dtype for training and rollouts: float32 | bfloat16")
    device: str = doc("cpu", "cpu | cuda | auto")
    lora_rank: int = doc(0, "0: train every weight; > 0: train LoRA adapters of this rank (peft, the `lora` extra) on the attention and MLP projections; the KL reference is the base model with adapters off, no copy")
    lora_alpha: float = doc(32.0, "LoRA scaling numerator (scale = lora_alpha / lora_rank)")
    max_tokens_per_micro_batch: int = doc(2048, "cap on the token positions one training forward encodes (SFT, GRPO update, supervision losses): micro-batches are cut so that shared prefix + rows × longest remainder stays under it, bounding activation memory (~1.2 MB per position for SmolLM2 under autocast) whatever the sampled lengths; 0: rows only (grpo.micro_batch_size). Scale it down for larger models")
    gradient_checkpointing: bool = doc(False, "recompute decoder-layer activations in backward: training memory no longer grows with layers × tokens, at ~1/3 more compute")
    autocast: bool = doc(False, "run training forward/backward under bf16 autocast (fp32 master weights): ~2× faster on AMX CPUs and GPUs (MEASURED.md: 13.5 vs 27 s per 8×512-token step)")


@dataclass
class DataConfig:
    source: str = doc("synthetic", "synthetic (generated KG, written into the run dir) | files (kb + question files below) | dir | jsonl (your own tasks for env.kind tools/mcp: data.train, data.dev; format in keel/tools/tasks.py)")
    seed: int = doc(0, "seed of the synthetic KG and questions")
    n_train: int = doc(1000, "synthetic: training questions")
    n_dev: int = doc(100, "synthetic: dev questions")
    n_test: int = doc(200, "synthetic: test questions")
    max_calls_per_turn: int = doc(6, "synthetic: skip questions whose gold needs more parallel calls in one turn (shorter trajectories on CPU)")
    kinds: list[str] = doc([], "synthetic: question kinds to generate, a subset of composition, conjunction, comparative, superlative (empty: all four)")
    max_hops: int = doc(0, "synthetic: skip questions whose gold needs more tool turns (hops) than this; 0: no limit")
    nationality_from_birth: float = doc(0.8, "synthetic: share of people whose nationality is their birth city's country (the rest: a random country); at 0.8 nationality is a one-hop shortcut for birth-country questions (GRPO was seen taking it); 0: independent")
    dir: str = doc("", "source=dir: a dataset directory with kb.tsv and train/dev/test.jsonl (from `keel data kg-synth`)")
    kb: str = doc("", "source=files: triples file (TSV head\\trelation\\ttail or |-separated, .gz ok)")
    train: str = doc("", "source=files: training questions (Keel JSONL, CWQ, PathQuestion, MetaQA); source=jsonl: your tasks, one JSON object a line")
    dev: str = doc("", "source=files/jsonl: dev questions; empty = a tenth of train, held out (shuffled with data.seed)")
    format: str = doc("auto", "question file format: auto | keel | cwq | pathquestion | metaqa")


@dataclass
class EnvConfig:
    kind: str = doc("kg", "kg (paper B's four verbs over a triple store) | fc_learn (paper A's function calling: templated multi-turn requests over BFCL's simulators, checker reward) | tools (your Python functions or an OpenAI tools file) | mcp (an MCP server's tools over stdio)")
    tools: list[str] = doc([], "kind=tools: the tool functions, each module:function or path/to/file.py:function; schemas from type hints + Google docstrings (transformers' get_json_schema)")
    tools_file: str = doc("", "kind=tools: a Python file whose every public function is a tool (make_state excluded)")
    tools_schema: str = doc("", "kind=tools: an OpenAI tools JSON file (a list of {type: function, function: {name, description, parameters}}); calls go to env.dispatcher")
    dispatcher: str = doc("", "kind=tools with tools_schema: module:function (or file.py:function) called as fn(name, arguments) or fn(name, arguments, state)")
    make_state: str = doc("", "kind=tools: module:function making the per-episode `state` from the task (empty: make_state of the tools' module, if any; its close() runs after the episode)")
    mcp_command: list[str] = doc([], "kind=mcp: the server command, e.g. [python, server.py] (stdio transport; one server process per run, restarted after a hang or crash)")
    instructions: str = doc("", "kind=tools/mcp: the system instructions (empty: Keel's default: use the tools, finish with <answer>...</answer>; a task's own system message wins)")
    call_timeout_s: float = doc(10.0, "kind=tools/mcp: seconds one call may take; then its answer is a TimeoutError (MCP: the server is restarted)")
    max_output_chars: int = doc(2000, "kind=tools/mcp: a tool answer longer than this is cut (with a count of what was cut)")
    informative_errors: bool = doc(False, "L_sig: failed queries say why ('ERROR: ...') instead of a silent []")
    plan: bool = doc(False, "KG: the prompt asks for a plan (verb and relation of each call, in order) in <think></think> before the first call, and gold trajectories write them (keel.kg.env.KGEnv.with_plan)")
    max_items: int = doc(30, "longest list a verb returns; the rest is summarised as a count")
    list_relations: bool = doc(True, "list the KG's relation names in the system prompt (paper B: False)")
    oracle_relations: bool = doc(False, "ablation: inject the gold relation for the next hop into each observation")
    readable_ids: bool = doc(False, "L_lang: show entities by readable name instead of opaque m. ids")
    accept_names: bool = doc(False, "L_comp: accept entity names (not only ids) as arguments")
    rename_schema: bool = doc(False, "L_prior: rename relations to unfamiliar opaque names")


@dataclass
class RolloutConfig:
    prompts_per_step: int = doc(8, "distinct questions per GRPO step")
    group_size: int = doc(4, "rollouts per question (GRPO group n; paper A: 8)")
    temperature: float = doc(1.0, "sampling temperature (paper A: 1.0; paper B: 0.7)")
    max_turns: int = doc(4, "assistant turns per episode (paper B: 5; paper A: up to 30)")
    max_new_tokens: int = doc(96, "tokens per assistant turn")
    max_total_tokens: int = doc(1536, "tokens per episode, prompt included")
    dtype: str = doc("float32", "float32 | bfloat16: sample with a bf16 copy of the weights (≈1.5–2× faster decode with AMX, MEASURED.md); the update then takes old log-probs from the fp32 policy itself, since bf16 sampling log-probs differ by ~0.04/token")


@dataclass
class SFTConfig:
    enabled: bool = doc(True, "run an SFT warm-start on gold trajectories before RL")
    steps: int = doc(40, "optimizer steps of the warm-start")
    batch_size: int = doc(8, "examples per SFT step (packed trajectories or single-step examples)")
    lr: float = doc(5e-5, "SFT learning rate (MEASURED.md: 5e-5 learned stopping in minutes; 1e-5 did not)")
    packed: bool = doc(True, "one example per trajectory with every assistant turn a target (same loss as single-step examples, fewer tokens)")
    warmup_steps: int = doc(0, "linear warm-up steps")


@dataclass
class GRPOConfig:
    steps: int = doc(10, "GRPO steps")
    lr: float = doc(1e-6, "RL learning rate (paper A: 1e-6; with interleaving 1e-5 was better)")
    warmup_steps: int = doc(0, "linear warm-up steps (paper A: 10)")
    clip_low: float = doc(0.2, "PPO clip range below 1 (ratio floor 1 - clip_low)")
    clip_high: float = doc(0.2, "PPO clip range above 1 (DAPO clip-higher uses 0.28)")
    kl_coef: float = doc(1e-4, "coefficient of the KL-to-reference loss (paper A: 1e-4; paper B notes: 0.05)")
    kl_estimator: str = doc("k3", "k1 | k3 (k3 = verl's low_var_kl)")
    scale_by_std: bool = doc(True, "divide centred rewards by the std of what they were centred on (Dr. GRPO: False)")
    baseline: str = doc("group", "what a reward is centred on: group (its group's mean, GRPO) | batch (the mean of the step's whole batch, REINFORCE with a batch baseline: groups that all succeed keep being reinforced)")
    loss_aggregation: str = doc("token-mean", "token-mean | seq-mean-token-mean")
    micro_batch_size: int = doc(8, "sequences per forward/backward (gradient accumulation; loss is identical)")
    max_grad_norm: float = doc(1.0, "gradient clipping norm")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    adam_eps: float = doc(1e-8, "AdamW epsilon of every optimizer in the run (SFT, RL, supervision phases)")
    skip_zero_advantage: bool = doc(True, "do not forward members whose advantage is 0 (uniform groups): their policy-gradient term is exactly 0; their KL term is dropped too")


@dataclass
class RewardConfig:
    name: str = doc("r_binary", "reward function, a key of keel.rewards.REWARDS (paper B ladder: r_binary, r_binary_sr, r_stepwise, r_toolverbs, r_selfv, ...; any task: answer_em, answer_f1, calls_succeeded) or your own module:function / file.py:function, called as fn(trajectory, task) -> (total, components)")


@dataclass
class EvalConfig:
    every: int = doc(5, "evaluate on dev every N GRPO steps (and at the end)")
    n_dev: int = doc(50, "dev questions per evaluation (a fixed subset)")
    before_sft: bool = doc(True, "evaluate the untrained model too, so summary.json shows before/after")
    batch_size: int = doc(25, "episodes per batched greedy rollout")
    max_new_tokens: int = doc(96, "tokens per assistant turn at evaluation")
    samples: int = doc(4, "decoded trajectories saved to samples/ at each evaluation")
    tool_lift_k: int = doc(16, "k of pass@k for tool lift (pass@k with tools − with tools disabled, paper B)")
    tool_lift_n: int = doc(0, "dev questions (a fixed subset) for tool lift at each evaluation; 0: off (it costs 2·k sampled episodes per question)")


@dataclass
class RunConfig:
    seed: int = doc(0, "seed of model init (tiny), data order and sampling")
    out: str = doc("runs", "parent directory of run directories (used when --out is not given)")
    malloc_mmap_threshold_mb: float = doc(0.0, "0: glibc's default; N > 0: allocations of N MB and more are mmapped and returned to the OS when freed (keel/memory.py; measured 3.2 → 1.5 GB peak RSS for a LoRA + checkpointing step at 2, updates ~35% slower)")
    checkpoint_every: int = doc(0, "save `latest` every N GRPO steps (0: only at evaluations and the end)")
    save_checkpoints: bool = doc(True, "write checkpoints/latest and checkpoints/peak")
    threads: int = doc(0, "torch CPU threads (0: torch's default)")
    progress: bool = doc(True, "show progress bars with ETA")


# --- the `detectors:` section (keel.diagnostics.detectors runs them) ---------------------------------
# The thresholds are Keel's, not the papers': the papers found these signatures by looking at
# plots after the fact. An alert fires once per episode of its condition.

ACTIONS = ("warn", "stop", "rollback")
ACTION_HELP = "what the trainer does on this alert: warn | stop | rollback"
ROLLBACK_HELP = "config overrides applied when rolling back (values like \"x5\" multiply)"


@dataclass
class KLSpikeConfig:
    """Control-token KL spike (paper A): a robust z-score of `kl/control_share` and of each
    `kl/tag/<tag>` against the median and MAD of their trailing window."""

    enabled: bool = doc(True, "run this detector")
    # A MAD from 20 values misjudged σ badly enough to raise a false alarm on Gaussian noise.
    window: int = doc(50, "trailing values (train steps) that form the baseline; the current value is not in it")
    min_history: int = doc(10, "values needed in the window before the detector can fire")
    z: float = doc(6.0, "robust z-score ((x − median) / (1.4826·MAD)) at or above which a value is a spike")
    # With the defaults a spike must exceed the median by at least 6 × 10% = 60% of it (paper A's spikes are several-fold).
    min_relative_scale: float = doc(0.1, "floor on the noise scale as a fraction of |median|, so a flat series (MAD ≈ 0) does not turn a small wiggle into a huge z")
    min_control_share: float = doc(0.2, "kl/control_share spikes count only when the share itself is at least this")
    action: str = doc("warn", ACTION_HELP)
    on_rollback: dict[str, str] = doc({"grpo.kl_coef": "x5"}, ROLLBACK_HELP)


@dataclass
class CliffConfig:
    """Post-peak cliff (paper B, mode 4): dev `eval/em` falls by `drop` below its running peak,
    and the fall happened within `within_evals` eval windows."""

    enabled: bool = doc(True, "run this detector")
    drop: float = doc(0.10, "absolute EM below the running peak that counts as collapsed (paper B: 0.395 → 0)")
    within_evals: int = doc(1, "the fall of at least `drop` must have happened since this many evals ago (1: one window)")
    min_peak: float = doc(0.05, "a run whose EM never reached this has no peak to fall from")
    action: str = doc("warn", ACTION_HELP)
    on_rollback: dict[str, str] = doc({"grpo.kl_coef": "x5"}, ROLLBACK_HELP + "; a rollback goes to the peak checkpoint")


@dataclass
class CallVolumeConfig:
    """Call-volume collapse (paper B, mode 4 signature): tools/question falls to at most
    `max_ratio` of its recent maximum. Watches `eval/tools_per_question` (raw, eval steps) and
    `tools/per_question` (train steps, smoothed by a trailing median)."""

    enabled: bool = doc(True, "run this detector")
    max_ratio: float = doc(0.5, "fire when the current value ≤ max_ratio × the maximum over the lookback (paper B: 3.0 → 1.0 is 0.33)")
    lookback_steps: int = doc(100, "steps over which the reference maximum is taken (two paper-B eval windows)")
    min_reference: float = doc(1.5, "the reference maximum must be at least this many calls per question")
    smooth: int = doc(5, "trailing median length for the train-step series (rollout batches are noisy)")
    action: str = doc("warn", ACTION_HELP)
    on_rollback: dict[str, str] = doc({}, ROLLBACK_HELP)


@dataclass
class EntropyConfig:
    """Entropy collapse: the trailing median of `tokens/entropy` falls below `fraction` of its
    early level (median of the first `early_steps` values)."""

    enabled: bool = doc(True, "run this detector")
    early_steps: int = doc(10, "values whose median is the early level")
    fraction: float = doc(0.3, "fire below this fraction of the early level")
    smooth: int = doc(5, "trailing median length of the current level")
    action: str = doc("warn", ACTION_HELP)
    on_rollback: dict[str, str] = doc({}, ROLLBACK_HELP)


@dataclass
class FormatDriftConfig:
    """Format-drift onset (paper B, mode 3): the trailing mean of `collapse/format_drift`
    (share of turns with a tool tag inside <think>) exceeds `threshold`."""

    enabled: bool = doc(True, "run this detector")
    threshold: float = doc(0.1, "share of turns with drift above which the detector fires")
    smooth: int = doc(3, "trailing mean length")
    action: str = doc("warn", ACTION_HELP)
    on_rollback: dict[str, str] = doc({}, ROLLBACK_HELP)


@dataclass
class ProxyGamingConfig:
    """Proxy gaming: over the last `window` steps `reward/mean` rose by at least
    `min_reward_rise` (least-squares slope × span) while dev `eval/em` rose by at most
    `max_em_gain` (last eval − first eval in the window, at least 2 evals)."""

    enabled: bool = doc(True, "run this detector")
    window: int = doc(100, "steps looked back")
    min_reward_rise: float = doc(0.1, "fitted rise of the training reward across the window that counts as up")
    max_em_gain: float = doc(0.0, "dev EM gain across the window at or below which EM counts as flat or down")
    action: str = doc("warn", ACTION_HELP)
    on_rollback: dict[str, str] = doc({}, ROLLBACK_HELP)


@dataclass
class DetectorConfig:
    kl_spike: KLSpikeConfig = doc(KLSpikeConfig(), "control-token KL spike (paper A)")
    cliff: CliffConfig = doc(CliffConfig(), "post-peak dev EM cliff (paper B, mode 4)")
    call_volume: CallVolumeConfig = doc(CallVolumeConfig(), "tools/question collapse (paper B, mode 4 signature)")
    entropy: EntropyConfig = doc(EntropyConfig(), "entropy collapse (paper B, modes 1 and 3)")
    format_drift: FormatDriftConfig = doc(FormatDriftConfig(), "tool tags inside <think> (paper B, mode 3)")
    proxy_gaming: ProxyGamingConfig = doc(ProxyGamingConfig(), "reward up, dev EM flat or down")

    def __post_init__(self) -> None:
        check_actions(self)


def check_actions(detectors: DetectorConfig) -> None:
    """Every detector's action is one of ACTIONS; a ConfigError names the key."""
    for f in dataclasses.fields(detectors):
        action = getattr(detectors, f.name).action
        if action not in ACTIONS:
            raise ConfigError(f"detectors.{f.name}.action must be {', '.join(ACTIONS[:-1])} or {ACTIONS[-1]}, got {action!r}")


# --- the `signals:` section (keel.signals.schedule turns it into a Schedule) ----------------------------

SUPERVISION_KINDS = ("sft", "ets", "reflection")  # supervision data kinds, in the order a phase mixes them
PARADIGMS = ("synchronous", "interleaved")
FAIL_AT_HELP = "a group whose every reward is <= this counts as failed"


@dataclass
class OPSConfig:
    enabled: bool = doc(False, "off-policy supervision: gold trajectories become members of every GRPO group")
    mode: str = doc("replace", "replace: `members` of the group_size slots hold the gold trajectory (authors' replace_num) | add: they join the group_size sampled ones (Eq. 4)")
    members: int = doc(1, "gold members per group (authors: replace_num=1 of n=8)")


@dataclass
class HintConfig:
    enabled: bool = doc(False, "hint-based guidance: a hint in the prompt while sampling, removed for the update")
    kinds: list[str] = doc(["first_call", "relation_path"], "hint texts, keys of keel.signals.hints.HINTS: first_call, relation_path, function_names")
    position: str = doc("system", "system (end of the system instructions, authors' placement) | user (end of the first user message)")
    only_failed: bool = doc(False, "hint a prompt only if its whole group scored <= fail_at the last time it was sampled")
    fail_at: float = doc(0.0, FAIL_AT_HELP)
    recompute_old_logprobs: bool = doc(True, "old log-probs of hinted rows = the current policy on the hint-free sequence (ratio 1, as verl); false: the sampling ones")


@dataclass
class ETSConfig:
    enabled: bool = doc(False, "erroneous trajectory supervision: gold SFT on prompts whose whole group failed")
    window: int = doc(50, "a failed prompt stays eligible for this many RL steps after its latest all-failed group")
    capacity: int = doc(256, "most prompts kept (the most recently failed)")
    fail_at: float = doc(0.0, FAIL_AT_HELP)


@dataclass
class ReflectionConfig:
    enabled: bool = doc(False, "process reflection supervision: train the policy to write an analyzer's reflection on its failed trajectories")
    analyzer: str = doc("rule", "rule (offline, replays the gold path) | llm (an OpenAI-compatible endpoint)")
    base_url: str = doc("", "llm analyzer: endpoint base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = doc("", "llm analyzer: model name sent to the endpoint")
    api_key: str = doc("", "llm analyzer: API key (empty: the OPENAI_API_KEY environment variable, else none)")
    per_step: int = doc(8, "reflections written per RL step, on failed trajectories")
    pool: int = doc(512, "most recent reflection examples kept for supervision")
    max_tokens: int = doc(2048, "longest reflection example (trajectory + request + reflection); longer ones are dropped")
    fail_at: float = doc(0.0, "a trajectory with reward <= this is reflected on")


@dataclass
class SelfDistillConfig:
    trajectories: str = doc("", "JSONL of kept episodes (keel.signals.restem.write_trajectories); set: the SFT warm-start trains on them instead of gold")


@dataclass
class SignalsConfig:
    paradigm: str = doc("interleaved", "how sft/ets/reflection losses enter: synchronous (weighted, inside each RL update) | interleaved (supervision phases between RL steps)")
    sft: bool = doc(False, "gold SFT of all training tasks as a supervision signal during RL (paper A's synchronous / interleaved SFT)")
    at_steps: list[int] = doc([], "interleaved: a supervision phase after each of these RL steps (paper A: 50, 100, 150)")
    every: int = doc(0, "interleaved: also a phase after every N RL steps (0: off)")
    epochs: int = doc(2, "interleaved: epochs over the phase's examples (paper A: 2)")
    lr: float = doc(1e-5, "learning rate of supervision phases (paper A: 1e-5); RL keeps grpo.lr")
    batch_size: int = doc(8, "examples per supervision step (paper A: 128)")
    sync_examples: int = doc(8, "synchronous: examples of each kind added to every RL update")
    sft_weight: float = doc(1.0, "synchronous: weight of the gold SFT loss")
    ets_weight: float = doc(1.0, "synchronous: weight of the ETS loss")
    reflection_weight: float = doc(1.0, "synchronous: weight of the reflection loss (Eq. 10)")
    ops: OPSConfig = doc(OPSConfig(), "OPS: gold trajectories as GRPO group members (keel.signals.ops)")
    hint: HintConfig = doc(HintConfig(), "hints in the prompt while sampling only (keel.signals.hints)")
    ets: ETSConfig = doc(ETSConfig(), "ETS: gold SFT on recently all-failed prompts (keel.signals.ets)")
    reflection: ReflectionConfig = doc(ReflectionConfig(), "PRS: reflections on failed trajectories as targets (keel.signals.reflection)")
    self_distill: SelfDistillConfig = doc(SelfDistillConfig(), "paper B's ReST-EM self-distillation (keel.signals.restem)")


def supervision_kinds(s: SignalsConfig) -> tuple[str, ...]:
    """The supervision data kinds that are on, in SUPERVISION_KINDS order."""
    on = {"sft": s.sft, "ets": s.ets.enabled, "reflection": s.reflection.enabled}
    return tuple(k for k in SUPERVISION_KINDS if on[k])


def check_signals(s: SignalsConfig) -> None:
    """Settings of the `signals:` section that contradict each other; a ConfigError names the key."""
    kinds = supervision_kinds(s)
    at_steps = list(s.at_steps)
    checks = [
        (s.paradigm in PARADIGMS, f"signals.paradigm must be one of {PARADIGMS}, got {s.paradigm!r}"),
        (all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in at_steps), f"signals.at_steps must be RL steps >= 1, got {at_steps}"),
        (at_steps == sorted(set(at_steps)), f"signals.at_steps must be increasing without repeats, got {at_steps}"),
        (s.every >= 0, f"signals.every must be >= 0, got {s.every}"),
        (s.epochs >= 1, f"signals.epochs must be >= 1, got {s.epochs}"),
        (s.lr > 0 and math.isfinite(s.lr), f"signals.lr must be a positive number, got {s.lr}"),
        (s.batch_size >= 1, f"signals.batch_size must be >= 1, got {s.batch_size}"),
        (s.sync_examples >= 1, f"signals.sync_examples must be >= 1, got {s.sync_examples}"),
        (min(s.sft_weight, s.ets_weight, s.reflection_weight) >= 0, "signals.*_weight must be >= 0"),
        (s.ops.mode in ("replace", "add"), f"signals.ops.mode must be replace or add, got {s.ops.mode!r}"),
        (s.ops.members >= 1 or not s.ops.enabled, f"signals.ops.members must be >= 1, got {s.ops.members}"),
        (s.reflection.analyzer in ("rule", "llm"), f"signals.reflection.analyzer must be rule or llm, got {s.reflection.analyzer!r}"),
        (s.reflection.analyzer != "llm" or not s.reflection.enabled or (s.reflection.base_url and s.reflection.model),
         "signals.reflection.analyzer=llm needs signals.reflection.base_url and signals.reflection.model"),
        (not (s.paradigm == "synchronous" and (at_steps or s.every)), "signals.at_steps / signals.every apply to the interleaved paradigm only"),
        (not (s.paradigm == "interleaved" and kinds and not (at_steps or s.every)),
         f"signals: {'/'.join(kinds)} is on with paradigm interleaved but no phase is scheduled; set signals.at_steps or signals.every"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


@dataclass
class Config:
    model: ModelConfig = doc(ModelConfig(), "the policy: which weights, their dtype and device, LoRA, training memory")
    data: DataConfig = doc(DataConfig(), "where tasks come from: a generated KG, question files, a dataset directory or your JSONL")
    env: EnvConfig = doc(EnvConfig(), "what the policy acts on: the KG's verbs, function calling, your tools or an MCP server")
    rollout: RolloutConfig = doc(RolloutConfig(), "sampling the episodes of a GRPO step")
    sft: SFTConfig = doc(SFTConfig(), "the SFT warm-start on gold trajectories before RL")
    grpo: GRPOConfig = doc(GRPOConfig(), "the RL update: GRPO and its variants")
    reward: RewardConfig = doc(RewardConfig(), "the reward of an episode")
    eval: EvalConfig = doc(EvalConfig(), "greedy evaluation on dev during and after training")
    run: RunConfig = doc(RunConfig(), "seed, output directory, checkpoints, threads")
    detectors: DetectorConfig = doc(DetectorConfig(), "collapse detectors over the metric history (keel.diagnostics.detectors): warn, stop or roll back")
    signals: SignalsConfig = doc(SignalsConfig(), "paper A's supervision signals and paper B's self-distillation (keel.signals)")
    report_to: list[str] = doc([], "external trackers besides metrics.jsonl: tensorboard, wandb, trackio, mlflow")


# `keel train ANY_PRESET --smoke`: the tiny model and a minimal budget, to check a config runs.
SMOKE: dict[str, Any] = {
    "model.name": "tiny",
    "model.dtype": "float32",
    "model.device": "cpu",
    "data.n_train": 16,
    "data.n_dev": 4,
    "data.n_test": 4,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_turns": 2,
    "rollout.max_new_tokens": 16,
    "sft.steps": 2,
    "sft.batch_size": 2,
    "grpo.steps": 2,
    "grpo.micro_batch_size": 4,
    "eval.every": 2,
    "eval.n_dev": 2,
    "eval.max_new_tokens": 16,
    "eval.samples": 2,
    "run.checkpoint_every": 1,
}


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _section(cfg, key: str) -> tuple[Any, str]:
    """The section that holds dotted `key`, and the key's last part: the one walk from the root
    to a key. Raises ConfigError naming the key (and the section's fields, for a wrong last part)."""
    parts = key.split(".")
    obj = cfg
    for i, p in enumerate(parts[:-1]):
        if not dataclasses.is_dataclass(obj) or p not in {f.name for f in dataclasses.fields(obj)}:
            raise ConfigError(f"unknown config key {'.'.join(parts[: i + 1])!r} (in {key!r})")
        obj = getattr(obj, p)
    leaf = parts[-1]
    if not dataclasses.is_dataclass(obj) or leaf not in {f.name for f in dataclasses.fields(obj)}:
        known = ", ".join(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else ""
        raise ConfigError(f"unknown config key {key!r}" + (f" (known in this section: {known})" if known else ""))
    return obj, leaf


def get_key(cfg: Config, key: str) -> Any:
    """The value at dotted `key` (`grpo.kl_coef`; a section for `grpo`). Raises ConfigError naming the key."""
    obj, leaf = _section(cfg, key)
    return getattr(obj, leaf)


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set `a.b` = value with a type check. Raises ConfigError naming the key."""
    obj, leaf = _section(cfg, key)
    expected = typing.get_type_hints(type(obj))[leaf]
    if dataclasses.is_dataclass(expected):
        raise ConfigError(f"config key {key!r} is a section; set its fields ({key}.<field>)")
    setattr(obj, leaf, _coerce(key, value, expected))


def fields_of(obj, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every field of the tree below `obj`, depth first: a section
    comes before its own fields."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        yield prefix + f.name, f, value
        if dataclasses.is_dataclass(value):
            yield from fields_of(value, f"{prefix}{f.name}.")


def leaves(cfg) -> dict[str, Any]:
    """Every key that is not a section, with its value: {"grpo.kl_coef": 0.0001, ...}."""
    return {key: value for key, _, value in fields_of(cfg) if not dataclasses.is_dataclass(value)}


def _coerce(key: str, value: Any, expected) -> Any:
    origin = typing.get_origin(expected)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} expects a mapping, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if origin in (list, tuple):
        (item,) = typing.get_args(expected)[:1] or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} expects a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} expects true/false, got {value!r}")
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} expects an integer, got {value!r}")
    if expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key {key!r} expects a number, got {value!r}")
    if expected is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key {key!r} expects a string, got {value!r}")
    return value


def apply_dict(cfg, d: dict[str, Any], where: str = "", prefix: str = "") -> None:
    """Set every leaf of a nested mapping, following the dataclass structure (a dict-typed
    field such as `on_rollback` takes its whole mapping). An error names `where` once."""
    try:
        _apply(cfg, d, prefix)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def _apply(cfg, d: dict[str, Any], prefix: str) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and dataclasses.is_dataclass(get_key(cfg, key)):
            _apply(cfg, v, key + ".")
            continue
        set_key(cfg, key, v)


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' → ('a.b', YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"  # the presets shipped with the repository


def resolve_preset(preset: str | Path) -> Path:
    """A preset path as given (relative to the current directory), else the same name under the
    repository's configs/: `smoke`, `smoke.yaml` and `configs/smoke.yaml` all work from any
    directory. Raises ConfigError listing where it looked."""
    given = Path(preset)
    if given.is_file():
        return given
    name = given.name if given.suffix == ".yaml" else given.name + ".yaml"
    tried = [given, Path.cwd() / "configs" / name, CONFIGS_DIR / name]
    if given.parent.name == "configs" or given.parent == Path("."):
        for candidate in tried[1:]:
            if candidate.is_file():
                return candidate
    looked = ", ".join(dict.fromkeys(str(p) for p in (tried if given.parent.name == "configs" or given.parent == Path(".") else tried[:1])))
    raise ConfigError(f"config file not found: {preset} (looked at {looked})")


def load_config(preset: str | Path | None = None, overrides: list[str] | None = None, smoke: bool = False) -> Config:
    """Defaults ← preset YAML ← smoke shrink ← --set overrides (later wins)."""
    cfg = Config()
    if preset:
        path = resolve_preset(preset)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
        except (IsADirectoryError, PermissionError) as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
        apply_dict(cfg, data, str(path))
    if smoke:
        for k, v in SMOKE.items():
            set_key(cfg, k, v)
        if cfg.signals.at_steps:  # make the smoke run reach an interleaved supervision phase
            cfg.signals.at_steps = [1]
        if cfg.signals.self_distill.trajectories and not Path(cfg.signals.self_distill.trajectories).exists():
            cfg.signals.self_distill.trajectories = ""  # smoke checks the loop, not a previous run's output
    for o in overrides or []:
        k, v = parse_override(o)
        set_key(cfg, k, v)
    validate(cfg)
    return cfg


ENV_KINDS = ("kg", "fc_learn", "tools", "mcp")


def validate(cfg: Config) -> None:
    """Cross-field checks that a type check cannot do; each error names the key."""
    from keel.kg.synth import KINDS
    checks = [
        (cfg.rollout.group_size >= 1, "rollout.group_size must be ≥ 1"),
        (cfg.rollout.prompts_per_step >= 1, "rollout.prompts_per_step must be ≥ 1"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0"),
        (cfg.rollout.max_turns >= 1, "rollout.max_turns must be ≥ 1"),
        (cfg.grpo.kl_estimator in ("k1", "k3"), f"grpo.kl_estimator must be k1 or k3, got {cfg.grpo.kl_estimator!r}"),
        (cfg.grpo.baseline in ("group", "batch"), f"grpo.baseline must be group or batch, got {cfg.grpo.baseline!r}"),
        (not (cfg.grpo.baseline == "batch" and cfg.signals.ops.enabled), "grpo.baseline: batch does not combine with signals.ops (OPS centres gold members on their own group, Eq. 4)"),
        (cfg.grpo.loss_aggregation in ("token-mean", "seq-mean-token-mean"), f"grpo.loss_aggregation must be token-mean or seq-mean-token-mean, got {cfg.grpo.loss_aggregation!r}"),
        (cfg.rollout.dtype in ("float32", "bfloat16"), f"rollout.dtype must be float32 or bfloat16, got {cfg.rollout.dtype!r}"),
        (cfg.model.dtype in ("float32", "bfloat16", "float16"), f"model.dtype must be float32, bfloat16 or float16, got {cfg.model.dtype!r}"),
        (cfg.env.kind in ENV_KINDS, f"env.kind must be one of {', '.join(ENV_KINDS)}, got {cfg.env.kind!r}"),
        (cfg.data.source in ("synthetic", "files", "dir", "jsonl"), f"data.source must be synthetic, files, dir or jsonl, got {cfg.data.source!r}"),
        (cfg.env.kind not in ("tools", "mcp") or cfg.data.source == "jsonl", f"env.kind={cfg.env.kind} takes its tasks from data.source=jsonl (data.train), got data.source={cfg.data.source!r}"),
        (cfg.data.source != "jsonl" or cfg.env.kind in ("tools", "mcp"), f"data.source=jsonl is for env.kind tools or mcp, got env.kind={cfg.env.kind!r}"),
        (cfg.env.kind != "mcp" or bool(cfg.env.mcp_command), "env.kind=mcp needs env.mcp_command, e.g. [python, server.py]"),
        (cfg.env.call_timeout_s > 0, "env.call_timeout_s must be > 0"),
        (set(cfg.data.kinds) <= set(KINDS), f"data.kinds must be a subset of {', '.join(KINDS)}, got {cfg.data.kinds!r}"),
        (cfg.data.max_hops >= 0, "data.max_hops must be ≥ 0 (0: no limit)"),
        (0.0 <= cfg.data.nationality_from_birth <= 1.0, "data.nationality_from_birth must be in [0, 1]"),
        (cfg.grpo.steps >= 0 and cfg.sft.steps >= 0, "grpo.steps and sft.steps must be ≥ 0"),
        # a group of one has advantage r - mean(r) = 0: GRPO would run and train nothing
        (cfg.rollout.group_size >= 2 or cfg.grpo.steps == 0 or cfg.grpo.baseline == "batch"
         or (cfg.signals.ops.enabled and cfg.signals.ops.mode == "add"),
         f"rollout.group_size={cfg.rollout.group_size}: GRPO's advantage is a reward minus its group's mean, so a group of one "
         "has advantage 0 and trains nothing; use ≥ 2 (paper A: 8), grpo.baseline=batch, or grpo.steps=0 for SFT only"),
        (cfg.eval.every >= 1, "eval.every must be ≥ 1"),
        (cfg.grpo.micro_batch_size >= 1, "grpo.micro_batch_size must be ≥ 1"),
        (cfg.model.max_tokens_per_micro_batch >= 0, "model.max_tokens_per_micro_batch must be ≥ 0 (0: no token cap)"),
        (cfg.model.device in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", cfg.model.device) is not None,
         f"model.device must be cpu, cuda, cuda:N or auto, got {cfg.model.device!r}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    _check_numbers(cfg)
    _check_names(cfg)
    check_signals(cfg.signals)
    if cfg.signals.ops.enabled and cfg.signals.ops.mode == "replace" and cfg.signals.ops.members >= cfg.rollout.group_size:
        raise ConfigError("signals.ops.members must be < rollout.group_size in replace mode (the group keeps sampled members)")


# (key, lowest allowed value, whether the bound itself is allowed): every float must also be finite
POSITIVE = [("sft.lr", 0, False), ("grpo.lr", 0, False), ("rollout.temperature", 0, False), ("grpo.max_grad_norm", 0, False),
            ("grpo.adam_eps", 0, False), ("model.lora_alpha", 0, False), ("signals.lr", 0, False),
            ("grpo.kl_coef", 0, True), ("grpo.clip_low", 0, True), ("grpo.clip_high", 0, True), ("grpo.weight_decay", 0, True),
            ("run.malloc_mmap_threshold_mb", 0, True), ("signals.sft_weight", 0, True), ("signals.ets_weight", 0, True),
            ("signals.reflection_weight", 0, True),
            ("eval.n_dev", 1, True), ("eval.batch_size", 1, True), ("eval.max_new_tokens", 1, True), ("eval.samples", 0, True),
            ("eval.tool_lift_k", 1, True), ("eval.tool_lift_n", 0, True), ("sft.batch_size", 1, True), ("sft.warmup_steps", 0, True),
            ("grpo.warmup_steps", 0, True), ("rollout.max_new_tokens", 1, True), ("rollout.max_total_tokens", 2, True),
            ("data.n_train", 1, True), ("data.n_dev", 1, True), ("data.n_test", 0, True), ("data.max_calls_per_turn", 1, True),
            ("model.lora_rank", 0, True), ("run.checkpoint_every", 0, True), ("run.threads", 0, True), ("env.max_items", 1, True),
            ("signals.ets.window", 1, True), ("signals.ets.capacity", 1, True)]


def _check_names(cfg: Config) -> None:
    """Names that the objects they configure would refuse only once the run directory exists
    (hint kinds, trackers), or never (a detector's action): checked here, each error naming its key."""
    from keel.trackers import parse_report_to

    check_actions(cfg.detectors)
    try:
        parse_report_to(cfg.report_to)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    hint = cfg.signals.hint
    if hint.enabled:  # the names live with the hints (keel.signals.hints), which import torch: only then
        from keel.rollout import HINT_POSITIONS
        from keel.signals.hints import HINTS

        unknown = [k for k in hint.kinds if k not in HINTS]
        if unknown:
            raise ConfigError(f"signals.hint.kinds: unknown hint kind(s) {unknown} (known: {', '.join(HINTS)})")
        if hint.position not in HINT_POSITIONS:
            raise ConfigError(f"signals.hint.position must be {' or '.join(HINT_POSITIONS)}, got {hint.position!r}")


def _check_numbers(cfg: Config) -> None:
    """Every float in the tree is finite (NaN or inf as a learning rate would be found only
    after the SFT phase, as a skipped update on every step), and the keys in POSITIVE are in
    range. Checked before anything is written."""
    for key, value in leaves(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
    for key, low, inclusive in POSITIVE:
        value = get_key(cfg, key)
        if value < low or (value == low and not inclusive):
            raise ConfigError(f"{key} must be {'≥' if inclusive else '>'} {low}, got {value!r}")


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe() -> str:
    """Every config key with its default and documentation (for --help-config)."""
    return "\n".join(f"{key}:  — {f.metadata['help']}" if dataclasses.is_dataclass(value) else f"  {key} = {value!r}  — {f.metadata['help']}"
                     for key, f, value in fields_of(Config()))
