"""Few-row fp32 products on CPU through a small C kernel (``gemv.c``), built on first use.

Decoding multiplies each weight matrix by 1..γ+1 rows per sequence, so its speed is how fast
the weights stream from memory. MKL's fp32 GEMV streams them at ~9 GB/s on the 2-core AMD
machine we measured on, whatever the layout; ``gemv.c`` reads every weight row once, dots it
with up to 4 input rows from L1, and streams at 16-18 GB/s for 1 row (a plain ``sum`` over the
same weights: 19-20) and ~12 GB/s for 8. It wins up to ``KERNEL_ROWS`` rows (``codraft bench gemv``).

Built with the system C compiler (``$CC``, default ``cc``; ~1 s) into
``$CODRAFT_CACHE/kernels``, one file per source, flags and CPU (it uses ``-march=native``).
It runs on OpenMP, i.e. torch's own thread pool (the same ``libgomp.so.1``), so
``torch.set_num_threads`` applies. No compiler, or ``CODRAFT_GEMV=0``: a warning (none for the
opt-out) and ``linear`` keeps using torch's products. Outputs match ``F.linear`` up to fp32
summation order.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

KERNEL_ROWS = 16  # `codraft bench gemv`, SmolLM2: 1.09x torch's product at 16 rows, 0.88x at 32
SOURCE = Path(__file__).with_name("gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({l for l in lines if l.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def build(cache_dir: Path | None = None) -> Path:
    """Compile gemv.c (if not cached) and return the shared library's path; raises on failure."""
    from codraft.models.smollm2 import cache_root
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "kernels"
    lib = folder / f"gemv-{key}.so"
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gemv-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: concurrent builders (pytest -n) each rename a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def kernel():
    """The C function, or None (disabled, or it could not be built: warned once)."""
    if os.environ.get("CODRAFT_GEMV", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(str(build())).gemv_rows
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"codraft: CPU GEMV kernel unavailable, few-row products use torch's (slower): {e}")
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return fn


def applies(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` takes this product: CPU fp32, no autograd, 1..KERNEL_ROWS rows, kernel built."""
    return (x2.shape[0] <= KERNEL_ROWS and x2.is_cpu and x2.dtype is torch.float32 and w.dtype is torch.float32
            and not (torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad))
            and w.is_contiguous() and kernel() is not None)


def gemv(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) @ wᵀ (O,I) -> (M,O) through the kernel; the caller checked ``applies``."""
    m, i = x2.shape
    o = w.shape[0]
    if w.shape[1] != i:
        raise ValueError(f"shape mismatch: x {tuple(x2.shape)} @ w {tuple(w.shape)}ᵀ")
    x2 = x2.contiguous()
    y = torch.empty(m, o)
    kernel()(x2.data_ptr(), w.data_ptr(), y.data_ptr(), m, i, o)
    return y
