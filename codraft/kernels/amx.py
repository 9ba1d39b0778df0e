"""Many-row products with bf16 weights on Intel AMX tiles (``amx.c``), where the CPU has them.

From ~8 rows on, the vector kernel (``codraft.kernels.gemv``) is bound by its multiply-adds, not
by the bytes of the weights it streams, so bf16 weights gained little over fp32 at batch 8 and a
verify of 40 rows was slower in bf16 than in fp32. A tile multiply does 16 x 16 x 32 products in
one instruction. AMX multiplies bf16 by bf16, so the fp32 activations are split exactly into three
bf16 parts; each product with a weight is exact and the sums are fp32: the result is
``F.linear(x, w.float())`` up to fp32 summation order, as the vector kernel's.

``ready()`` says whether this machine can run it (built for AMX by ``-march=native``, and Linux
granted the process the tile state); ``applies`` adds the shapes it takes (inputs a multiple of 32,
outputs of 16). Whether it is the fastest path for a row count is measured like the others
(``codraft.kernels.products``). Not here: the vector kernel's fallback inside ``gemm_amx_bf16``,
which only guards a misuse.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from codraft.kernels import cbuild, gemv


@functools.cache
def kernel():
    """The C function, or None: kernels off or not built, or no AMX here."""
    lib = cbuild.library()
    if lib is None or gemv.kernel() is None:  # (gemv: the library's tuning, set once)
        return None
    lib.amx_ready.restype = ctypes.c_int
    if not lib.amx_ready():
        return None
    fn = lib.gemm_amx_bf16
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return fn


def ready() -> bool:
    """Whether this machine runs the AMX kernel."""
    return kernel() is not None


def applies(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemm`` can take this product: x2 CPU fp32, w bf16 contiguous (no autograd), inputs a
    multiple of 32 and outputs of 16, AMX here."""
    return (w.dtype is torch.bfloat16 and w.dim() == 2 and w.shape[1] % 32 == 0 and w.shape[0] % 16 == 0
            and cbuild.fits(x2) and cbuild.weight_fits(w) and kernel() is not None)


def gemm(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) fp32 @ wᵀ (O,I) bf16 -> (M,O) fp32 on AMX tiles; the caller checked ``applies``."""
    m, i = x2.shape
    if w.shape[1] != i:
        raise ValueError(f"shape mismatch: x {tuple(x2.shape)} @ w {tuple(w.shape)}ᵀ")
    x2 = x2.contiguous()
    y = torch.empty(m, w.shape[0])
    kernel()(x2.data_ptr(), w.data_ptr(), y.data_ptr(), m, i, w.shape[0])
    return y
