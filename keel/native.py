"""Keel's small native kernels (keel/decode_ops.c), compiled on first use, with torch as fallback.

At decode shapes (batch 16, SmolLM2's 576-wide rows) an eager torch op costs 5–40 µs of dispatch,
allocation and dtype round trips for microseconds of arithmetic, and a decode step runs ~45 of
them per layer: RMSNorm alone is nine ops (upcast, square, mean, add, rsqrt, multiply, downcast,
weight multiply), rotary six, the residual adds and SwiGLU four more. keel/decode_ops.c does each
fused group in one pass over the rows, with the same roundings as transformers' forward in the
same dtype (fp32 or bf16). No maintained library ships these fused CPU ops for this torch
(intel-extension-for-pytorch, which did, stopped at torch 2.8), so Keel compiles its own ~100
lines of C with the system's C compiler once per machine and source (`cc -O3 -march=native`,
cached under keel.models.cache_dir()/native) and calls them through ctypes.

`ops()` returns the loaded library, or None — no compiler, a failed build, or KEEL_NATIVE=0 in
the environment — and keel.decode then runs the same step in torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_ops.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]

_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
SIGNATURES = {
    "keel_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _I],
    "keel_rotary": [_P, _P, _P, _I, _I, _I, _L, _I],
    "keel_silu_mul": [_P, _P, _I, _I, _I],
    "keel_sample": [_P, _I, _I, _F, _P, _P, _P, _P],
    "keel_decode_attention": [_P, _L, _P, _P, _I, _I, _P, _P, _L, _L, _I, _P, _L, _P, _P, _I, _I, _I, _I, _F, _I],
}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def build(cc: str, dest: Path) -> Path:
    """Compile SOURCE into `dest` (a shared library); raises CalledProcessError with cc's message."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, dest)  # atomic: a concurrent build or a killed one never leaves half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


@functools.cache
def ops() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot be had."""
    if os.environ.get("KEEL_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.info("keel.native: no C compiler found; the decode step runs in torch ops")
        return None
    from keel.models import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode() + _cpu_id().encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"decode_ops-{key}.so"
    try:
        if not path.exists():
            build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("keel.native: could not build %s (%s); the decode step runs in torch ops", SOURCE.name, detail.strip().splitlines()[-1:] )
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib
