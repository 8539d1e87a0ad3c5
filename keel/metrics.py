"""Every metric name Keel writes, in one place, grouped by slash prefix.

Trackers, detectors, the report and `keel diagnose` read these names; nothing else invents a
metric key. A per-step line of `metrics.jsonl` is `{"step": int, "<prefix>/<name>": float, ...}`.
Eval keys appear only on eval steps. Families whose members are open-ended (reward
components, KL per control tag) use the `*_PREFIX` constants plus a suffix.
"""

from __future__ import annotations

STEP = "step"
PHASE = "phase"  # "sft" | "rl" | "eval": which phase wrote the line (string, not plotted)

# rollout/
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"  # policy tokens sampled per second of rollout
ROLLOUT_POLICY_TOKENS = "rollout/policy_tokens"
ROLLOUT_MEAN_TURNS = "rollout/mean_turns"
ROLLOUT_TRUNCATED = "rollout/truncated_share"
ROLLOUT_RESPONSE_LEN = "rollout/response_len_mean"

# reward/
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_COMPONENT_PREFIX = "reward/"  # + component name, e.g. reward/em, reward/f1
REWARD_MIXED_GROUPS = "reward/mixed_groups"  # share of groups with non-zero reward variance
REWARD_REDRAWN = "reward/redrawn_batches"  # flat batches set aside this step before the one trained on (grpo.redraw_flat)

# loss/
LOSS_TOTAL = "loss/total"
LOSS_POLICY = "loss/policy"
LOSS_KL = "loss/kl"
LOSS_SFT = "loss/sft"
LOSS_REFLECTION = "loss/reflection"
LOSS_CLIP_LOW = "loss/clip_low_frac"  # share of policy tokens clipped on the low side (A<0)
LOSS_CLIP_HIGH = "loss/clip_high_frac"
LOSS_RATIO_MEAN = "loss/ratio_mean"
LOSS_GRAD_NORM = "loss/grad_norm"
LOSS_SKIPPED = "loss/skipped_nonfinite"  # 1 when the update was skipped for a NaN/inf
LOSS_TRAINED_MEMBERS = "loss/trained_members"  # group members that entered the update (non-zero advantage)

# kl/
KL_MEAN = "kl/mean"  # k3 per policy token, mean
KL_K1_MEAN = "kl/k1_mean"
KL_K3_MEAN = "kl/k3_mean"
KL_CONTROL_SHARE = "kl/control_share"  # share of total KL carried by control-tag tokens
KL_TAG_PREFIX = "kl/tag/"  # + tag name, mean k3 on that tag's tokens
KL_TEXT = "kl/text"  # mean k3 on ordinary text tokens

# tokens/
TOKENS_ENTROPY = "tokens/entropy"  # mean per-token entropy of the policy on its own tokens
TOKENS_CONTROL_FREQ_PREFIX = "tokens/freq/"  # + tag: occurrences per trajectory
TOKENS_CONTROL_FREQ_REF_PREFIX = "tokens/freq_ref/"  # same under the reference model's rollouts
TOKENS_TAG_BALANCE = "tokens/tag_balance"  # |#open - #close| / (#open + #close) for <tool_call>

# tools/
TOOLS_PER_QUESTION = "tools/per_question"
TOOLS_VALID_CALLS = "tools/valid_call_share"  # share of calls that parsed and executed
TOOLS_EMPTY_RESULTS = "tools/empty_result_share"
TOOLS_FAILURE_FREQUENCY = "tools/failure_frequency"  # share of calls whose answer was a failure (Observation.ok False: refused, raised, timed out)
TOOLS_DISTINCT_NONEMPTY = "tools/distinct_nonempty"
TOOLS_ERRORS_PREFIX = "tools/error/"  # + error kind (bad_json, unknown_tool, ...): count per step

# collapse/ (structural states, paper A; format drift, paper B)
COLLAPSE_HEALTHY_CALL = "collapse/healthy_tool_call"
COLLAPSE_HEALTHY_RESPONSE = "collapse/healthy_response"
COLLAPSE_TEXT_POLLUTION = "collapse/text_pollution"
COLLAPSE_FULL = "collapse/full_collapse"
COLLAPSE_FORMAT_DRIFT = "collapse/format_drift"

# signal/ (supervision signals, paper A)
SIGNAL_OPS_MEMBERS = "signal/ops_members"
SIGNAL_HINTED_GROUPS = "signal/hinted_groups"
SIGNAL_ETS_BUFFER = "signal/ets_buffer"
SIGNAL_SFT_EXAMPLES = "signal/sft_examples"
SIGNAL_REFLECTIONS = "signal/reflections"

# eval/ (dev set, greedy; only on eval steps)
EVAL_EM = "eval/em"
EVAL_F1 = "eval/f1"
EVAL_FORMAT_VALID = "eval/format_valid"  # share of episodes whose every call parsed and that answered with <answer>
EVAL_ANSWERED = "eval/answered"  # share of episodes that produced an <answer>
EVAL_TOOLS_PER_QUESTION = "eval/tools_per_question"
EVAL_CVT = "eval/cvt"  # correct and the answer appears verbatim in some tool output
EVAL_TOOL_LIFT = "eval/tool_lift"  # pass@k with tools − pass@k with tools disabled (paper B)
EVAL_PASS_AT_K_TOOLS = "eval/pass_at_k_tools"
EVAL_PASS_AT_K_NO_TOOLS = "eval/pass_at_k_no_tools"
EVAL_N = "eval/n"

# rl_lift/ (summary.json only): the RL phase's effect, final eval vs the post-SFT eval, paired per question
RL_LIFT_EM = "rl_lift/em"  # final EM − post-SFT EM on the same dev questions
RL_LIFT_P_VALUE = "rl_lift/p_value"  # exact McNemar (binomial) test on the discordant pairs
RL_LIFT_N = "rl_lift/n"  # questions in both evaluations
RL_LIFT_GAINED = "rl_lift/gained"  # wrong after SFT, right at the end
RL_LIFT_LOST = "rl_lift/lost"  # right after SFT, wrong at the end
RL_LIFT_EM_AFTER_SFT = "rl_lift/em_after_sft"  # EM of the post-SFT eval on those questions
RL_LIFT_EM_FINAL = "rl_lift/em_final"  # EM of the final eval on those questions

# time/ and mem/
TIME_ROLLOUT = "time/rollout_s"
TIME_UPDATE = "time/update_s"
TIME_STEP = "time/step_s"
TIME_WALL = "time/wall_s"  # since the run started (differs between a resumed and a straight run)
MEM_PEAK_RSS = "mem/peak_rss_mb"

OPTIM_LR = "optim/lr"

# alerts/
ALERT_COUNT = "alerts/count"  # alerts raised at this step (details in alerts.jsonl)
ALERT_ROLLBACK = "alerts/rollback"  # 1 at a step where the policy was rolled back to the peak checkpoint

# Keys whose values depend on wall time or the machine, excluded when comparing two runs.
NONDETERMINISTIC_PREFIXES = ("time/", "mem/", "rollout/tokens_per_s")

# --- names added by other modules go below this line (keep grouped by prefix) ---
# tokens/ (keel.diagnostics.telemetry.ControlFrequencyBaseline)
TOKENS_CONTROL_FREQ_RATIO_PREFIX = "tokens/freq_ratio/"  # + tag: (policy + 0.1) / (reference + 0.1) occurrences per trajectory
TOKENS_CONTROL_FREQ_MAX_RATIO = "tokens/freq_max_ratio"  # largest of those ratios
# loss/ and signal/ (keel.signals)
LOSS_ETS = "loss/ets"  # synchronous ETS: NLL of gold single-step examples of recently all-failed prompts
SIGNAL_REFLECTION_ERRORS = "signal/reflection_errors"  # analyzer calls that failed (endpoint errors) at this step
SIGNAL_PHASE = "signal/phase_steps"  # optimizer steps of the interleaved supervision phase run after this RL step


def supervision_loss_key(kind: str) -> str:
    """The metric of a supervision kind's loss inside an RL update (synchronous paradigm):
    loss/sft, loss/ets, loss/reflection — "loss/" + the kind, so a new kind needs no entry here."""
    return "loss/" + kind
