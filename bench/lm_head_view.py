"""The LM head on the last column of a batch: a strided [B, 1, H] view vs a contiguous copy.

transformers' `logits_to_keep=1` slices the hidden states to `h[:, -1:, :]`, a view with the
batch stride of the whole block. On this CPU build of torch (2.13), a bf16 `F.linear` on that
view takes a path that materialises the weight once per row (B × V × H × 2 bytes: 2.8 GB for
SmolLM2's 49,152 × 576 head at batch 50) and runs 100-300× slower than on a contiguous input.
Keel's rollout asks for the last column with an index tensor, which makes the slice a copy
(keel.rollout._last_column). This script measures both, with the peak RSS each adds.

    python bench/lm_head_view.py            # --batch 50 --width 40 --dtype bfloat16
Ends with `strided_vs_contiguous=<x>` (time ratio, medians of --reps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _peak_added_mb(fn) -> float:
    """Peak RSS the call adds (Linux: reset VmHWM, read it after); nan elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        fn()
        return _status("VmHWM") - before
    except OSError:
        fn()
        return float("nan")


def _status(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--width", type=int, default=40, help="columns of the block (a tool response)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    weight = torch.randn(a.vocab, a.hidden, dtype=dtype)
    hidden = torch.randn(a.batch, a.width, a.hidden, dtype=dtype)
    index = torch.tensor([a.width - 1])
    ways = {
        "strided": lambda: torch.nn.functional.linear(hidden[:, -1:, :], weight),  # transformers' int logits_to_keep
        "contiguous": lambda: torch.nn.functional.linear(hidden[:, index, :], weight),  # Keel's index tensor
    }
    diff = float((ways["strided"]().float() - ways["contiguous"]().float()).abs().max())  # the same product, other kernels
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(a.reps):  # interleaved repetitions
        for name, fn in ways.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    mem = {name: _peak_added_mb(fn) for name, fn in ways.items()}
    print(f"torch {torch.__version__}, {a.dtype}, batch {a.batch}, block width {a.width}, head {a.vocab}×{a.hidden}, {a.threads} threads; max |difference| {diff:.2g}")
    for name in ways:
        print(f"{name:>10}: {statistics.median(times[name]) * 1e3:9.1f} ms   peak RSS +{mem[name]:7.0f} MB")
    ratio = statistics.median(times["strided"]) / statistics.median(times["contiguous"])
    print(f"strided_vs_contiguous={ratio:.1f}")


if __name__ == "__main__":
    main()
