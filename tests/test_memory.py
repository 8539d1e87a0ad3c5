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
