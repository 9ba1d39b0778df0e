"""Few-row fp32 products on CPU through a small C kernel (``gemv.c``), built on first use.

Decoding multiplies each weight matrix by 1..γ+1 rows per sequence, so its speed is how fast
the weights stream from memory, and MKL's fp32 GEMV streams them well below the machine's read
speed whatever the layout. ``gemv.c`` reads every weight row once and dots it with up to 4
input rows from L1, close to a plain ``sum`` over the same weights at 1 row. It wins up to
``KERNEL_ROWS`` rows (``codraft bench gemv``; figures in docs/bench-spec.md).

Built on first use by ``codraft.kernels.cbuild``; it runs on OpenMP, i.e. torch's own thread
pool, so ``torch.set_num_threads`` applies. No compiler, or ``CODRAFT_KERNELS=0``: ``kernel()``
is None (with a warning, none for the opt-out). Outputs match ``F.linear`` up to fp32 summation
order. Not here: choosing between it and torch's products (``codraft.kernels.products``).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from codraft.kernels import cbuild

KERNEL_ROWS = 16  # beyond this torch's product wins again (`codraft bench gemv`)


@functools.cache
def kernel():
    """The C function, or None (``CODRAFT_KERNELS=0``, or it could not be built: warned once)."""
    lib = cbuild.library()
    if lib is None:
        return None
    fn = lib.gemv_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return fn


def applies(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` takes this product: CPU fp32, no autograd, 1..KERNEL_ROWS rows, kernel built."""
    return x2.shape[0] <= KERNEL_ROWS and w.is_contiguous() and cbuild.fits(x2, w) and kernel() is not None


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
