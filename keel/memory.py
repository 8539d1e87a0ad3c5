"""Peak host memory on CPU: keep glibc from holding freed tensor memory.

Training frees and re-allocates many mid-sized tensors (a decoder layer's activations for a
micro-batch are a few MB). glibc serves allocations below its mmap threshold (dynamic, up to
32 MB) from the heap, and a fragmented heap is not returned to the OS: measured on one SmolLM2
GRPO step with LoRA and gradient checkpointing (bench/step_memory.py), peak RSS 3.2 GB of which
~1.2 GB are live tensors. With the threshold fixed at 2 MB, allocations of 2 MB and more are
mmapped and unmapped on free: peak 1.46 GB, update ~35% slower (page faults on fresh maps).
Between phases the trainer also hands the heap's free pages back (`release_free_memory`): the
main job's peak RSS went from 10.4 to 9.4 GB, wall time 8 min 58 s vs 8 min 51 s.

The fixed threshold applies to training (SFT steps, GRPO updates, supervision phases), where the
heap creeps over micro-batches of differing lengths. Rollouts and evaluations allocate per decode
step (logits, the growing cache); mmapped, each of those faults in fresh pages, so while
`keel.rollout.rollout` runs the threshold is raised to glibc's ceiling (`decoding_heap`) and set
back after. The main job with 1 MB for the whole run: peak RSS 5,333 → 4,841 MiB, rollouts 15–25%
slower, updates unchanged, results identical (LOG.md, twentieth session).

The opposite choice, `keep_freed_memory` (`run.keep_freed_memory`, the main job's): nothing is
handed back, every freed page is reused. Where fresh pages are slow to get, as in a VM that
returns freed pages to its host, that is faster (the main job 7:25 → 6:45 on an AMD EPYC VM) for
a higher peak (4.22 → 4.41 GB; LOG.md, thirty-ninth session).

oneDNN, which runs PyTorch's bf16 matrix multiplies on CPU, keeps what it built for every GEMM
shape it has seen in two caches of 1,024 entries each: its primitive cache
(ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's LRU cache in PyTorch (LRU_CACHE_CAPACITY), each
entry with its own buffers (pytorch/pytorch#27971, intel/ideep#14). A GRPO update's micro-batches
each have a new length, as do a rollout's batches when rows finish, so over a run both caches
fill with shapes that never come back. `import keel` sets both capacities to 32
(`limit_onednn_caches`) unless the environment already names them. The main job (seed 0) on an
AMX Xeon: peak RSS 5,321 → 4,360 MiB, wall 7:03 → 6:22 (rollouts and updates ~15% faster a
step), every metric and answer the same; with oneDNN's cache alone capped, 4,729 MiB (LOG.md,
twenty-fifth session).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os

from keel.errors import UserError

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
HEAP_CEILING_MB = 32  # glibc's ceiling for its dynamic threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
KEEP_BELOW_MB = 1024  # keep_freed_memory: allocations under this come from the heap
KEEP_TRIM_BYTES = 2**31 - 1  # keep_freed_memory: glibc's trim threshold (the largest int it takes)

ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 32, "LRU_CACHE_CAPACITY": 32}  # environment variable → entries

_threshold_mb: float | None = None  # what set_mmap_threshold fixed; None: glibc's own dynamic threshold
_keep = False  # keep_freed_memory was called: nothing is handed back to the OS


@functools.cache
def _glibc(function: str):
    """A glibc function by name, or None where there is none (macOS, musl). Looked up once:
    `find_library` may run `ldconfig`, and the trainer trims after every step."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):
        return None


def set_mmap_threshold(megabytes: float) -> bool:
    """Fix glibc's mmap threshold at `megabytes` (this also stops its dynamic adjustment).
    Returns False where there is no glibc `mallopt` (macOS, musl): nothing changes there."""
    global _threshold_mb
    if megabytes <= 0:
        raise UserError(f"run.malloc_mmap_threshold_mb must be > 0, got {megabytes}")
    if not _mallopt_threshold(megabytes):
        return False
    _threshold_mb = megabytes
    return True


def _mallopt(param: int, value: int) -> bool:
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(param, value))


def _mallopt_threshold(megabytes: float) -> bool:
    return _mallopt(M_MMAP_THRESHOLD, int(megabytes * 1024 * 1024))


def keep_freed_memory() -> bool:
    """From now on, memory this process frees stays in it for reuse: glibc serves allocations under
    KEEP_BELOW_MB from its heap and never trims the heap's top, and `release_free_memory` hands
    nothing back. Where the OS gives a process fresh pages slowly, re-using them is the faster
    choice: in a VM whose freed pages go back to the host (free page reporting), a page touched
    for the first time costs ~0.3 ms per MB against ~0.05 to write it again (256 MB: 71–78 ms
    against 10–11). One GRPO update of SmolLM2 on the bench's batch, replayed, faulted in
    0.7–0.8 M pages (~3 GB) with a trim before each update and none with this: 10.8–12.6 s
    against 10.8–11.4 s an update (processes alternated), and the main job's seed 0, run back to
    back, spent 80 s instead of 96 in its SFT steps (6:45 instead of 7:25 in all), with the same
    results and a peak RSS of 4.41 GB instead of 4.22 (LOG.md, thirty-ninth session). The cost: the heap holds its
    high-water mark. Not reversible within the process. Returns False where there is no glibc
    `mallopt` (nothing changes there)."""
    global _keep, _threshold_mb
    if not (_mallopt_threshold(KEEP_BELOW_MB) and _mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_BYTES)):
        return False
    _keep = True
    _threshold_mb = None  # decoding_heap has nothing to raise
    return True


def kept_memory_environment() -> dict[str, str]:
    """glibc's environment variables that give a new process the thresholds `keep_freed_memory`
    sets in this one (a process Keel does not run itself, e.g. a baseline's, which has no trims
    of Keel's to switch off)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(KEEP_BELOW_MB * 2**20), "MALLOC_TRIM_THRESHOLD_": str(KEEP_TRIM_BYTES)}


@contextlib.contextmanager
def decoding_heap():
    """Inside: glibc's threshold at its ceiling, so a rollout's per-step tensors come from the heap
    (freed chunks reused, no page faults); after: the threshold `set_mmap_threshold` fixed. Nothing
    happens when no threshold was fixed (glibc's dynamic one) or it is at the ceiling already.
    Also a decorator (`@decoding_heap()`, as on keel.rollout.rollout)."""
    low = _threshold_mb
    if low is None or low >= HEAP_CEILING_MB:
        yield
        return
    _mallopt_threshold(HEAP_CEILING_MB)
    try:
        yield
    finally:
        _mallopt_threshold(low)


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`). Between phases of a
    run (rollout → update, after a step or an evaluation) the previous phase's freed tensors sit
    in glibc's heap at sizes the next phase does not reuse well, and count towards peak RSS.
    Takes milliseconds; returns False where there is no glibc `malloc_trim`, or after
    `keep_freed_memory` (nothing changes)."""
    trim = _glibc("malloc_trim")
    if trim is None or _keep:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def limit_onednn_caches() -> dict[str, str]:
    """Cap oneDNN's two per-shape caches (the module docstring) at ONEDNN_CACHES' capacities where
    the environment does not set them already; returns the capacities in effect. oneDNN reads
    them once, at a process's first bf16 matrix multiply on CPU: `import keel` calls this, so a
    process that multiplied bf16 matrices before importing keel keeps the defaults (1,024)."""
    return {name: os.environ.setdefault(name, str(capacity)) for name, capacity in ONEDNN_CACHES.items()}
