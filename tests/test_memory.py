"""keel.memory: glibc's mmap threshold can be fixed at run time (Linux/glibc here)."""

import platform

import pytest

from keel.memory import set_mmap_threshold


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_mmap_threshold_is_set_on_glibc():
    assert set_mmap_threshold(2) is True
    assert set_mmap_threshold(32) is True  # glibc's usual ceiling; set back to it


def test_bad_threshold_is_refused_by_name():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="run.malloc_mmap_threshold_mb must be > 0"):
            set_mmap_threshold(bad)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_free_memory_returns_a_fragmented_heap():
    import torch

    from keel.memory import release_free_memory

    set_mmap_threshold(32)  # 4 MB tensors come from the heap, as a step's activations do
    freed = [torch.ones(1024, 1024) for _ in range(100)]  # 400 MB, pages touched
    pin = torch.ones(1024, 1024)  # allocated above them: free() alone cannot shrink the heap's top
    del freed
    before = _rss_mb()
    assert release_free_memory() is True
    after = _rss_mb()
    assert before - after > 300, (before, after)
    del pin


_PROBE_RSS = """
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
"""

_DECODING_HEAP_PROBE = """
import torch
from keel import memory
""" + _PROBE_RSS + """
def freed_mb():
    blocks = [torch.ones(1024, 1024) for _ in range(50)]  # 200 MB, pages touched
    pin = torch.ones(1024, 1024)  # above them: free() alone cannot shrink the heap's top
    before = rss_mb()
    del blocks
    return before - rss_mb()

assert memory.set_mmap_threshold(1)
outside = freed_mb()
with memory.decoding_heap():
    inside = freed_mb()
print(outside, inside)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_decoding_heap_keeps_rollout_tensors_on_the_heap():
    """With a 1 MB threshold fixed, freed 4 MB tensors leave RSS at once (they were mmapped);
    inside decoding_heap they come from the heap and stay until a trim. In a fresh process: what
    free() returns depends on the heap's history."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DECODING_HEAP_PROBE], capture_output=True, text=True, check=True).stdout
    outside, inside = map(float, out.split())
    assert outside > 150, out  # mmapped: unmapped on free
    assert inside < 50, out  # heap: held until trimmed


def test_decoding_heap_raises_the_threshold_and_sets_it_back_only_when_one_was_fixed(monkeypatch):
    from keel import memory

    calls = []
    monkeypatch.setattr(memory, "_threshold_mb", None)
    monkeypatch.setattr(memory, "_mallopt_threshold", lambda mb: calls.append(mb) or True)
    with memory.decoding_heap():
        pass
    assert calls == []
    monkeypatch.setattr(memory, "_threshold_mb", 2)
    with memory.decoding_heap():
        assert calls == [memory.HEAP_CEILING_MB]
    assert calls == [memory.HEAP_CEILING_MB, 2]


_KEEP_PROBE = """
import resource, sys
import torch
from keel import memory
""" + _PROBE_RSS + """
mode = sys.argv[1]  # keep: keep_freed_memory(); environment: memory.kept_memory_environment() set, no trims; default
if mode == "keep":
    assert memory.keep_freed_memory()

def cycle():
    blocks = [torch.ones(16, 1024, 1024)] + [torch.ones(1024, 1024) for _ in range(25)]  # one of 64 MB, 100 MB in 4 MB tensors
    pin = torch.ones(1024, 1024)  # above them: free() alone cannot shrink the heap's top
    del blocks
    return pin

pins = [cycle(), cycle()]  # the second round settles where each size fits
held = rss_mb()
trimmed = memory.release_free_memory() if mode != "environment" else None
handed_back = held - rss_mb()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pins.append(cycle())
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(trimmed, handed_back, faults)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_kept_freed_memory_is_reused_without_page_faults():
    """164 MB allocated and freed twice (one tensor of 64 MB, above glibc's 32 MB ceiling, and
    4 MB ones), then a trim, then a third round. With keep_freed_memory the trim hands nothing back
    and the third round reuses most pages: 1,000–9,000 faults measured (where glibc places each
    size varies from process to process), not the ~42,000 of 164 MB of fresh 4 KB pages; so does
    a process given `kept_memory_environment` and no trim (18,000–21,000 without it: the 64 MB
    tensor mmapped anew). With glibc's defaults and the trim, the trim returns what the heap held
    and the 64 MB tensor is mmapped anew, so the third round faults them all in again. Fresh
    processes: the heap's history decides."""
    import os
    import subprocess
    import sys

    from keel.memory import kept_memory_environment

    def probe(mode: str, env: dict[str, str] | None = None) -> tuple[str, float, int]:
        out = subprocess.run([sys.executable, "-c", _KEEP_PROBE, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, **(env or {})}).stdout.split()
        return out[0], float(out[1]), int(out[2])

    trimmed, handed_back, faults = probe("keep")
    assert (trimmed, handed_back < 10, faults < 15_000) == ("False", True, True), (trimmed, handed_back, faults)
    _, handed_back, faults = probe("environment", kept_memory_environment())  # a process of glibc's own, no trims
    assert (handed_back < 10, faults < 15_000) == (True, True), (handed_back, faults)
    trimmed, handed_back, faults = probe("default")
    assert (trimmed, handed_back > 50, faults > 40_000) == ("True", True, True), (trimmed, handed_back, faults)


def test_keep_freed_memory_turns_trims_and_decoding_heap_into_no_ops(monkeypatch):
    from keel import memory

    calls = []
    monkeypatch.setattr(memory, "_mallopt", lambda param, value: calls.append((param, value)) or True)
    monkeypatch.setattr(memory, "_keep", False)
    monkeypatch.setattr(memory, "_threshold_mb", 2)
    assert memory.keep_freed_memory() is True
    assert calls == [(memory.M_MMAP_THRESHOLD, memory.KEEP_BELOW_MB * 2**20), (memory.M_TRIM_THRESHOLD, 2**31 - 1)]
    assert memory.release_free_memory() is False
    with memory.decoding_heap():
        pass
    assert len(calls) == 2  # no threshold raised and set back


_ONEDNN_PROBE = """
import torch
import keel  # caps oneDNN's caches unless the environment names them (keel.memory.limit_onednn_caches)
""" + _PROBE_RSS + """
torch.set_num_threads(1)
w = torch.randn(1536, 576, dtype=torch.bfloat16, requires_grad=True)
x0 = torch.randn(400, 576, dtype=torch.bfloat16)
(x0[:8] @ w.T).sum().backward()
before = rss_mb()
for rows in range(100, 250):  # a new length per step, as an update's micro-batches have
    x = x0[:rows].clone().requires_grad_()
    (x @ w.T).sum().backward()
print(rss_mb() - before)
"""


def _environment_without_cache_capacities() -> dict[str, str]:
    import os

    from keel.memory import ONEDNN_CACHES

    return {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHES}


def _onednn_growth_mb(**env: str) -> float:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], capture_output=True, text=True, check=True,
                         env={**_environment_without_cache_capacities(), **env}).stdout
    return float(out.split()[-1])


def test_importing_keel_caps_onednn_caches_unless_the_environment_names_them():
    import subprocess
    import sys

    clean = _environment_without_cache_capacities()
    show = "import os, keel; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"

    def run(env: dict[str, str]) -> list[str]:
        return subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True, env=env).stdout.split()

    assert run(clean) == ["32", "32"]
    assert run({**clean, "LRU_CACHE_CAPACITY": "1024"}) == ["32", "1024"]  # the user's value stays


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc")
def test_capped_onednn_caches_keep_memory_flat_over_new_shapes():
    """150 bf16 GEMM shapes, forward and backward: with oneDNN's default capacities (1,024 each)
    every shape's primitives stay resident; with keel's (32) the old ones are dropped. Measured
    on an AMX Xeon: +396 MB vs +68 MB (+263 MB with oneDNN's own cache capped alone)."""
    from keel.models import native_bf16

    if not native_bf16("cpu"):
        pytest.skip("bf16 matrix multiplies do not run through oneDNN's bf16 kernels on this CPU")
    default = _onednn_growth_mb(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    capped = _onednn_growth_mb()
    if default < 100:
        pytest.skip(f"oneDNN's caches hold little memory on this CPU ({default:.0f} MB over 150 shapes)")
    assert capped < default / 3, (capped, default)
