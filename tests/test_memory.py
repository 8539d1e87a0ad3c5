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


_DECODING_HEAP_PROBE = """
import torch
from keel import memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

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
