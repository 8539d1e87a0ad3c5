"""Keel's native kernels (keel/decode_ops.c), compiled on first use, with torch ops as fallback.

At decode shapes (batch 16, SmolLM2's 576-wide rows) an eager torch op costs 5–40 µs of dispatch,
allocation and dtype round trips for microseconds of arithmetic, and a decode step ran ~45 of
them per layer: RMSNorm alone is nine ops (upcast, square, mean, add, rsqrt, multiply, downcast,
weight multiply), rotary six, the residual adds and SwiGLU four more; the attention over a
shared prefix and the rows' own keys was two flash-attention calls and a dozen ops to merge them;
sampling six ops over the 49k-token vocabulary. keel/decode_ops.c does each group in one call:
the element-wise groups with the same roundings as transformers' forward in the same dtype (fp32
or bf16), the attention and the sampling in fp32 (keel.decode, keel.rollout._choose); where the
CPU has AMX or AVX512-BF16 (and the compiler targets it), a bf16 attention whose shared-prefix
part runs as bf16 matrix products with fp32 sums (`bf16_kernels`); and, with AVX512-BF16, the
bf16 training attention of keel.logprobs' forwards and backwards under autocast
(keel_train_attention: torch's CPU flash kernel computes bf16 at fp32 speed without AMX). The
decode step's rotary (keel_rotary) serves the training forwards too, forward and backward:
transformers' four ops in one pass with their roundings, bit for bit. With AVX512-BF16 the
decode step's bf16 linear layers are keel_linear_pairs: oneDNN's sums in oneDNN's order, the
weights read as one stream a tile (keel.decode._Pairs), and a step's decoder layers can run in one
call (keel_decode_layers: the same kernels in the same order, without Python between them).

No maintained library ships these fused CPU ops for this torch (intel-extension-for-pytorch,
which did, stopped at torch 2.8), so Keel compiles its own with the system's C compiler, once per
machine and source (`cc -O3 -march=native -fopenmp`, 4 s; without -fopenmp or -march=native
where the compiler refuses them), caches the library under keel.models.cache_dir()/native and
calls it through ctypes. With PyPI's torch the library's OpenMP is torch's own libgomp (already
loaded, so the attention's threads are torch's threads: `torch.set_num_threads` applies).

`ops()` returns the loaded library, or None — no compiler, every build failed, or KEEL_NATIVE=0
in the environment — and the callers then run the same work in torch ops.
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
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-math-errno"]
# tried in order: the first set the compiler accepts is built
FLAG_SETS = [["-march=native", "-fopenmp"], ["-march=native"], []]

_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
SIGNATURES = {  # name: (argument types, result type)
    "keel_add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, _I], None),
    "keel_rotary": ([_P, _L, _L, _L, _I, _P, _P, _I, _L, _P, _L, _L, _L, _I, _I, _I, _I, _I, _I], None),
    "keel_silu_mul": ([_P, _P, _I, _I, _I], None),
    "keel_append_kv": ([_P, _L, _P, _P, _L, _L, _L, _I, _I, _I, _I, _I], None),
    "keel_sample": ([_P, _I, _I, _F, _P, _P, _P, _P], None),
    "keel_decode_attention": ([_P, _L, _P, _P, _I, _I, _P, _P, _L, _L, _I, _P, _L, _P, _P, _I, _I, _I, _I, _F, _I], None),
    "keel_amx": ([], _I),
    "keel_attention_scratch": ([_I, _I, _I, _I, _I, _I, _I], _L),
    "keel_decode_attention_amx": ([_P, _L, _P, _P, _I, _P, _P, _L, _L, _I, _P, _L, _P, _P, _I, _I, _I, _I, _F], None),
    "keel_dpbf16": ([], _I),
    "keel_decode_attention_dpbf16": ([_P, _L, _P, _P, _I, _P, _P, _L, _L, _I, _P, _L, _P, _P, _I, _I, _I, _I, _F], None),
    "keel_train_attention_scratch": ([_I, _I, _I, _I, _I, _I, _I], _L),
    "keel_train_attention": ([_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F], None),
    "keel_train_attention_backward": ([_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F], None),
    "keel_pack_pairs": ([_P, _P, _I, _I], None),
    "keel_linear_pairs": ([_P, _P, _P, _I, _I, _I, _I], None),
    "keel_decode_layer_fields": ([], _I),
    "keel_decode_layers": ([_P, _I] + [_P] * 12 + [_L, _P, _L, _L, _L, _I, _I, _I, _I, _I, _I, _I, _I, _F, _F], None),
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


def build(cc: str, dest: Path) -> list[str]:
    """Compile SOURCE into the shared library `dest` with the first of FLAG_SETS the compiler
    accepts; returns those flags. Raises CalledProcessError (the last attempt's) if none builds.
    Written to a temporary file and renamed: a concurrent or killed build never leaves half a
    library at `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        for extra in FLAG_SETS:
            done = subprocess.run([cc, *BASE_FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, dest)
                return extra
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def ops() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot be had."""
    if os.environ.get("KEEL_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.info("keel.native: no C compiler found; the decode step runs in torch ops")
        return None
    import torch  # noqa: F401  (loaded first, so the library's libgomp.so.1 resolves to torch's)

    from keel.models import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *BASE_FLAGS, *map(" ".join, FLAG_SETS)]).encode()
                         + _cpu_id().encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"decode_ops-{key}.so"
    try:
        if not path.exists():
            flags = build(cc, path)
            log.info("keel.native: built %s with %s %s", path.name, cc, " ".join(flags) or "(no -march=native, no OpenMP)")
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        log.warning("keel.native: could not build %s with %s (%s); the decode step runs in torch ops", SOURCE.name, cc,
                    detail[-1] if detail else "no message")
        return None
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def bf16_kernels(lib: ctypes.CDLL | None) -> list[str]:
    """The bf16 decode attentions that read the shared prefix in bf16 which `lib` (an `ops()`
    library) can run here, fastest first: "amx" (keel_decode_attention_amx: the prefix's two
    products as AMX tile matrix products; built for a CPU with AMX, and the OS lets this process
    use the tiles), "dpbf16" (keel_decode_attention_dpbf16: the same arithmetic in AVX512-BF16 dot
    products; built for a CPU with AVX512-BF16). KEEL_AMX=0, resp. KEEL_DPBF16=0, in the
    environment removes one; with neither, bf16 runs the kernel that reads the prefix in fp32."""
    if lib is None:
        return []
    found = []
    if os.environ.get("KEEL_AMX", "1") != "0" and lib.keel_amx() == 1:
        found.append("amx")
    if os.environ.get("KEEL_DPBF16", "1") != "0" and lib.keel_dpbf16() == 1:
        found.append("dpbf16")
    return found
