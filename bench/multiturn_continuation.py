"""Multi-turn cost of Keel's rollout engine: time per generated token at 8 turns vs 1 turn.

The engine appends each turn's tool responses to the same KV cache (ragged lengths become
masked holes) instead of re-encoding the history, so a token sampled in turn 8 should cost
about what a token in turn 1 costs; the target is ≤ 1.2×.

Setup: SmolLM2-135M, a batch of episodes whose every assistant turn is steered to the same
tool call (`steer`; forced tokens go through the same decode step as sampled ones, one
forward per token), and a fake environment answering each call with a list of 6–20 items
(ragged, ~20–60 tokens per response, different per row and turn). 1 turn = one call turn;
8 turns = eight call turns with seven tool responses in between (the eighth turn hits
max_turns, so no response follows it). Generated tokens: 8× as many in the second case.
Repetitions are interleaved (1, 8, prefill, 1, 8, prefill, ...), medians reported.

Three ratios: per generated token over the whole call (prefill amortised over 8× more tokens
in the 8-turn case, which flatters it); after subtracting the prefill (measured by a run that
samples one token per row and never decodes), the last line; and decoding only, which also
leaves out the time spent appending the seven tool responses (`append_s` in the trajectories'
info). Appending is work any engine must do once per response; the responses here (~70 tokens)
are twice a turn's 34 generated tokens, so at batch 16, where a decode step costs little per
row, encoding them is a large share of the 8-turn time.

    python bench/multiturn_continuation.py                  # batch 16, also 1 and 4, 3 reps (~6 min)
    python bench/multiturn_continuation.py --batch 32 --turns 8 --reps 5
Ends with `multiturn_ratio=<ratio>` (prefill excluded, at --batch); `multiturn_ratio_batchN=`
and `multiturn_decode_ratio_batchN=` lines report the other batch sizes (--also).

What bounds the ratio: a decode step reads every weight once (540 MB fp32) and every row's
cached keys and values (30 layers × 3 KV heads × 64 × 2 × 4 B = 46 KB per token of history, per
row). The prompts' shared prefix is read once per step (keel/cascade.py) and hole columns are
dropped after each tool block (`keel.rollout._compact`), but each row's own history grows from
tens of tokens (1 turn) to ~900 (8 turns, tool responses included), so at batch 16 its cache read
per step grows to ~660 MB, more than the weights. At batch 1 the cache is small next to the
weights and the ratio measures the engine's own overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from keel.models import load_model
from keel.rollout import SamplingParams, rollout
from keel.types import Observation, Task, ToolCall

SIZES = (6, 20, 11, 16, 8, 18, 13, 9)  # items per tool response: "m.0xxxx"-like ids, 3 tokens each


class RaggedEpisode:
    def __init__(self, offset: int):
        self.offset = offset
        self.calls = 0

    def execute(self, call: ToolCall) -> Observation:
        n = SIZES[(self.offset + self.calls) % len(SIZES)]
        self.calls += 1
        return Observation(text="[" + ", ".join(f'"m.0{k:03d}"' for k in range(n)) + "]", ok=True)

    def next_user_message(self):
        return None

    def close(self):
        pass


class RaggedEnv:
    """One tool; responses of 6–20 items, shifted per task so rows are ragged within a block."""

    name = "ragged"

    def tools(self, task):
        return [{"type": "function", "function": {"name": "lookup", "description": "Look an id up",
                                                  "parameters": {"type": "object", "properties": {"entity": {"type": "string"}}, "required": ["entity"]}}}]

    def system_prompt(self, task):
        return "Answer the question using the tools. To finish, reply <answer>NAME</answer>."

    def user_message(self, task):
        return task.question

    def start(self, task):
        return RaggedEpisode(int(task.id))


def run(model, tok, batch: int, turns: int, steer_ids: list[int] | None, seed: int) -> tuple[float, int, float]:
    """(seconds, generated tokens, seconds spent appending tool responses) of one batched rollout."""
    tasks = [Task(id=str(i), question=f"Which films did the director of film {i} make?", answers=["x"]) for i in range(batch)]
    if steer_ids is None:  # prefill only: one sampled token per row, then the turn is cut
        params = SamplingParams(max_turns=1, max_new_tokens=1)
        steer = None
    else:
        params = SamplingParams(max_turns=turns, max_new_tokens=len(steer_ids), max_total_tokens=100_000)
        steer = lambda row, turn: steer_ids  # noqa: E731
    t0 = time.perf_counter()
    trajs = rollout(model, tok, RaggedEnv(), tasks, params, generator=torch.Generator().manual_seed(seed), steer=steer)
    elapsed = time.perf_counter() - t0
    if steer_ids is not None:
        assert all(len(t.turn_spans) == turns for t in trajs), [len(t.turn_spans) for t in trajs]
    return elapsed, sum(t.num_policy_tokens for t in trajs), trajs[0].info["append_s"]


def measure(model, tok, call: list[int], batch: int, turns: int, reps: int) -> tuple[float, float, float]:
    """(ratio with prefill, ratio without prefill, decode-only ratio) at one batch size."""
    res: dict[str, list[tuple[float, int, float]]] = {"1": [], "many": [], "prefill": []}
    for rep in range(reps):
        res["1"].append(run(model, tok, batch, 1, call, rep))
        res["many"].append(run(model, tok, batch, turns, call, rep))
        res["prefill"].append(run(model, tok, batch, 1, None, rep))
        print(f"  batch {batch} rep {rep}: 1 turn {res['1'][-1][0]:.2f} s, {turns} turns {res['many'][-1][0]:.2f} s, "
              f"prefill {res['prefill'][-1][0]:.2f} s", flush=True)
    prefill = statistics.median(t for t, _, _ in res["prefill"])
    one_t, one_n = statistics.median(t for t, _, _ in res["1"]), res["1"][0][1]
    many_t, many_n = statistics.median(t for t, _, _ in res["many"]), res["many"][0][1]
    append = statistics.median(a for _, _, a in res["many"])
    print(f"batch {batch}: prefill only {prefill:.2f} s; 1 turn {one_t:.2f} s for {one_n} tokens "
          f"({1000 * (one_t - prefill) / one_n:.1f} ms/token without prefill); {turns} turns {many_t:.2f} s for {many_n} tokens "
          f"({1000 * (many_t - prefill) / many_n:.1f} ms/token without prefill), of which {append:.2f} s appending "
          f"{turns - 1} tool responses ({1000 * (many_t - prefill - append) / many_n:.1f} ms/token decoding only)", flush=True)
    return ((many_t / many_n) / (one_t / one_n), ((many_t - prefill) / many_n) / ((one_t - prefill) / one_n),
            ((many_t - prefill - append) / many_n) / ((one_t - prefill) / one_n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="the batch of the last line")
    ap.add_argument("--also", default="1,4", help="further batch sizes to report (comma-separated, '' for none)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="weights dtype of the sampler: float32 | bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", dtype=args.dtype)
    model.eval()
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"entity": "m.0abc12"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    run(model, tok, 2, 2, call, 0)  # warm-up
    print(f"{len(call)} tokens per turn, {args.dtype}, threads {torch.get_num_threads()}, reps {args.reps}")
    others = [int(b) for b in args.also.split(",") if b.strip()]
    for b in others:
        _, without, decode = measure(model, tok, call, b, args.turns, args.reps)
        print(f"multiturn_decode_ratio_batch{b}={decode:.2f}")
        print(f"multiturn_ratio_batch{b}={without:.2f}")
    with_prefill, without, decode = measure(model, tok, call, args.batch, args.turns, args.reps)
    print(f"multiturn_ratio_with_prefill={with_prefill:.2f}")
    print(f"multiturn_decode_ratio={decode:.2f}")
    print(f"multiturn_ratio={without:.2f}")


if __name__ == "__main__":
    main()
