"""Batched sampling throughput: Keel's rollout engine vs transformers `generate`, SmolLM2-135M.

Same prompts (KG task prompts from the synthetic graph: ~560 shared tokens of system block and
tool schemas, then a ragged question), same batch, same number of new tokens, temperature 1
over the full vocabulary, one assistant turn, no early stop on either side:
- generate: do_sample, temperature 1, top_k 0 and top_p 1 (SmolLM2's generation config would
  otherwise apply top-k 50), min_new_tokens = max_new_tokens = N (EOS is masked until N);
- Keel: the tokenizer passed to `rollout` reports <|im_end|> as id -1, which is never sampled,
  so every row runs to max_new_tokens (then the turn counts as truncated and no tool is run).
Repetitions are interleaved A/B/C/A/B/C on one machine; medians and ratios are printed.

    python bench/sampler_vs_generate.py                        # batch 16, 64 new tokens, 2 reps (~5 min)
    python bench/sampler_vs_generate.py --batch 32 --new-tokens 128 --reps 3
    python bench/sampler_vs_generate.py --no-bf16              # fp32 only

Variants (each dtype against `generate` in the same dtype):
- "keel": the shipped engine. On CPU the prompts' shared prefix is kept once per layer and
  read once per step (keel.cascade); the questions and every generated token go in the rows'
  own cache.
- "keel repeated prefix": the same engine with keel.cascade switched off, so the prefix's keys
  and values are repeated per row (what the engine did before; the prefix is still encoded once).
- bf16: the same on a bf16 copy of the weights (the trainer's `rollout.dtype: bfloat16`).
Then the limit, measured in the same run: (a) this machine's memory bandwidth (a plain copy of
a 256 MB tensor: bytes read + written per second), (b) the model's linear layers alone at the
bench's batch and each dtype — every weight matrix once, LM head included, one row per batch
element, each weight laid out as Keel's decode step lays it out (`keel.decode.laid_out`: the
weights in oneDNN's blocked format, bf16 where its bf16 kernels exist, fp32 at batch 4 or more;
bf16 in pairs for keel_linear_pairs where the CPU has AVX512-BF16 and it gives oneDNN's values) — the floor any decode engine
built on these GEMM kernels has per step, with the time the weights alone take to stream at (a), and (c) Keel's decode step (rollout time minus
prefill, per new token), as ratios to (b). (b) is measured right after each Keel rollout of its
dtype, and `decode_step_vs_linears_*` is the median over repetitions of each rollout's step over
the floor measured next to it (the machine's speed drifts by several percent between minutes;
one floor measured at the end made that ratio move by ±0.04 between runs).
Ends with `speedup_vs_generate=<ratio>` (shipped engine vs generate, both fp32).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from keel.chat import IM_END
from keel.kg.env import KGEnv
from keel.kg.synth import generate_splits
from keel.models import load_model
from keel.rollout import SamplingParams, encode_prompt, rollout


class NoStopTokenizer:
    """The tokenizer, except that <|im_end|> maps to id -1, so the rollout never stops a row early."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def convert_tokens_to_ids(self, token):
        return -1 if token == IM_END else self._tok.convert_tokens_to_ids(token)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def kg_setup(n_tasks: int, seed: int = 0):
    """(env, tasks) of the synthetic KG task that Keel trains on by default."""
    kg, splits = generate_splits(seed=seed, train=max(n_tasks, 8), dev=1, test=1)
    return KGEnv(kg.store), splits["train"][:n_tasks]


def time_generate(model, tok, prompts: list[list[int]], new_tokens: int, seed: int) -> float:
    """Seconds for `generate` to sample new_tokens for every (left-padded) prompt."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=pad)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens, out.shape
    return elapsed


DECODE_S: dict[str, list[float]] = {}  # variant → seconds per decode step (rollout minus prefill, per new token)


def time_keel(model, tok, env, tasks, new_tokens: int, seed: int, label: str = "") -> float:
    params = SamplingParams(temperature=1.0, max_turns=1, max_new_tokens=new_tokens, max_total_tokens=100_000)
    t0 = time.perf_counter()
    trajs = rollout(model, NoStopTokenizer(tok), env, tasks, params, generator=torch.Generator().manual_seed(seed))
    elapsed = time.perf_counter() - t0
    assert all(t.num_policy_tokens == new_tokens for t in trajs), [t.num_policy_tokens for t in trajs]
    if label:
        DECODE_S.setdefault(label, []).append((elapsed - trajs[0].info["prefill_s"]) / new_tokens)
    return elapsed


def memory_bandwidth(reps: int = 5, megabytes: int = 256) -> float:
    """Bytes per second of a plain copy (each byte read once and written once), best of reps."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def linears_only_s(model, batch: int, reps: int = 7) -> tuple[float, int]:
    """(median seconds, weight bytes) of every nn.Linear of the model once (the tied LM head
    included) at `batch` rows in the weights' dtype, laid out as the decode step lays them out:
    the GEMMs of one decode step and nothing else — no norms, rotary, attention, cache or
    sampling."""
    from keel.decode import laid_out

    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
    laid = [(inputs[w.shape[1]], laid_out(w, batch)) for w in weights]  # as Keel's decode step multiplies by them
    times = []
    with torch.no_grad():
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            for x, w in laid:
                w(x)
            if rep:  # the first pass warms the kernels up
                times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(w.numel() * w.element_size() for w in weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each variant (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 variants")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import keel.rollout as engine

    model, tok = load_model("smollm2")
    model.eval()
    env, tasks = kg_setup(args.batch)
    prompts = [encode_prompt(tok, env, t)[0] for t in tasks]
    print(f"batch {args.batch}, {args.new_tokens} new tokens, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"threads {torch.get_num_threads()}, reps {args.reps}", flush=True)

    shipped = engine._cascade_attention

    def repeated(model_, s):
        engine._cascade_attention = lambda m, enabled: shipped(m, False)
        try:
            return time_keel(model_, tok, env, tasks, args.new_tokens, s)
        finally:
            engine._cascade_attention = shipped

    models = {"fp32": model}
    if not args.no_bf16:
        models["bf16"] = load_model("smollm2", dtype="bfloat16")[0].eval()
    variants = {}
    for dt, m in models.items():
        variants[f"generate {dt}"] = lambda s, m=m: time_generate(m, tok, prompts, args.new_tokens, s)
        variants[f"keel {dt}"] = lambda s, m=m, dt=dt: time_keel(m, tok, env, tasks, args.new_tokens, s, label=dt)
        variants[f"keel {dt} repeated prefix"] = lambda s, m=m: repeated(m, s)
    # warm-up (first calls allocate caches, build kernels): not timed
    for m in models.values():
        time_keel(m, tok, env, tasks[:2], 4, 0)
        time_generate(m, tok, prompts[:2], 4, 0)
    times: dict[str, list[float]] = {k: [] for k in variants}
    floors: dict[str, list[float]] = {dt: [] for dt in models}  # the linears alone, right after each Keel rollout
    weight_bytes: dict[str, int] = {}
    for rep in range(args.reps):
        for name, fn in variants.items():
            times[name].append(fn(rep))
            print(f"  rep {rep} {name:26s} {times[name][-1]:7.2f} s", flush=True)
            dt = name.split()[1]
            if name == f"keel {dt}":  # paired with its decode steps: the machine's speed drifts between minutes
                floor, weight_bytes[dt] = linears_only_s(models[dt], args.batch)
                floors[dt].append(floor)
    n_tokens = args.batch * args.new_tokens
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'variant':26s} {'median s':>9s} {'tokens/s':>9s} {'vs generate (same dtype)':>25s}")
    for name, t in med.items():
        anchor = med["generate " + name.split()[1]]
        print(f"{name:26s} {t:9.2f} {n_tokens / t:9.1f} {anchor / t:24.2f}x")
    for dt in models:
        print(f"speedup_vs_generate_{dt}_repeated_prefix={med[f'generate {dt}'] / med[f'keel {dt} repeated prefix']:.2f}")
        print(f"speedup_vs_generate_{dt}={med[f'generate {dt}'] / med[f'keel {dt}']:.2f}")
    if "bf16" in models:
        print(f"speedup_keel_bf16_vs_generate_fp32={med['generate fp32'] / med['keel bf16']:.2f}")
    bandwidth = memory_bandwidth()
    print(f"\nthe limit, measured now: memory bandwidth {bandwidth / 1e9:.1f} GB/s (256 MB copy)")
    for dt in models:
        floor, step = statistics.median(floors[dt]), statistics.median(DECODE_S[dt])
        ratios = [s / f for s, f in zip(DECODE_S[dt], floors[dt])]  # each rep's decode step over the floor measured right after it
        print(f"  {dt}: linears alone at batch {args.batch} {floor * 1e3:.1f} ms ({weight_bytes[dt] / 1e6:.0f} MB of weights: "
              f"{weight_bytes[dt] / bandwidth * 1e3:.1f} ms at bandwidth); Keel decode step {step * 1e3:.1f} ms; per rep "
              f"{', '.join(f'{s * 1e3:.1f} / {f * 1e3:.1f} ms' for s, f in zip(DECODE_S[dt], floors[dt]))}")
        print(f"linears_vs_bandwidth_{dt}={floor / (weight_bytes[dt] / bandwidth):.2f}")
        print(f"decode_step_vs_linears_{dt}={statistics.median(ratios):.2f}")
    print(f"speedup_vs_generate={med['generate fp32'] / med['keel fp32']:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
