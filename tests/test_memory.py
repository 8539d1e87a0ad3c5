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
