"""Few-row products on CPU through a small C kernel (``gemv.c``), built on first use: fp32
activations times fp32 or bf16 weights, fp32 out.

Decoding multiplies each weight matrix by 1..γ+1 rows per sequence, so its speed is how fast
the weights stream from memory. ``gemv.c`` reads every weight row from memory once (prefetched)
and dots it with the input rows (two weight rows by 4 input rows at a time) from L1: about
torch's speed at 1-2 rows, up to 2x it at 4-8. bf16 weights (the rollout engine's weight-only bf16 copy) stream half the bytes, ~2x
faster at 1 row, less as the rows make it compute-bound; each is widened to fp32 exactly and the
sums are fp32, so the result is ``F.linear(x, w.float())`` up to fp32 summation order.

Built on first use by ``codraft.kernels.cbuild``; it runs on OpenMP, i.e. torch's own thread
pool, so ``torch.set_num_threads`` applies. No compiler, or ``CODRAFT_KERNELS=0``: ``kernel()``
is None (with a warning, none for the opt-out). ``applies`` says whether the kernel *can* take a
product, at any row count; not here: whether it is the fastest for that row count
(``codraft.kernels.products``).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from codraft.kernels import cbuild


@functools.cache
def kernel() -> dict | None:
    """The C functions by weight dtype (fp32, bf16), or None (``CODRAFT_KERNELS=0``, or they
    could not be built: warned once)."""
    lib = cbuild.library()
    if lib is None:
        return None
    fns = {torch.float32: lib.gemv_rows, torch.bfloat16: lib.gemv_rows_bf16}
    for fn in fns.values():
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return fns


def applies(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` can take this product, at any row count: CPU, x2 fp32, w fp32 or bf16 and
    contiguous, no autograd, kernel built."""
    return cbuild.fits(x2) and cbuild.weight_fits(w) and kernel() is not None


def gemv(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) fp32 @ wᵀ (O,I) fp32 or bf16 -> (M,O) fp32 through the kernel; the caller checked
    ``applies``."""
    m, i = x2.shape
    o = w.shape[0]
    if w.shape[1] != i:
        raise ValueError(f"shape mismatch: x {tuple(x2.shape)} @ w {tuple(w.shape)}ᵀ")
    x2 = x2.contiguous()
    y = torch.empty(m, o)
    kernel()[w.dtype](x2.data_ptr(), w.data_ptr(), y.data_ptr(), m, i, o)
    return y
