"""Few-row products ``x @ wᵀ`` on CPU: the fast ``linear`` the kernel-enabled layers use.

Four paths compute the same product: the C kernel (``codraft.kernels.gemv``), the same on a copy
of the weight packed in panels (``codraft.kernels.panels``), MKL's ``x @ wᵀ`` (``F.linear``) and the
same computed as ``(w @ xᵀ)ᵀ``, which MKL runs through other code that can be faster for some row
counts; with bf16 weights on a CPU with AMX, a fifth: the tile kernel (``codraft.kernels.amx``).
Which one is fastest for a weight's shape and dtype at a row count is measured on this machine the
first time the shape is used (``codraft.kernels.dispatch``; above the measured row counts
(prefills), the fastest at the largest one of the paths that scale: torch's and AMX). A bf16 weight
(weight-only rollout copies; x stays fp32) goes to the kernels as is and to torch's products widened
per call. Autograd, other devices and other dtypes keep ``F.linear``. Outputs match ``F.linear`` (of
the widened weight) up to fp32 summation order. Not here: the kernels themselves, and which modules
use this (``codraft.kernels.fast_layers``).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from codraft.kernels import amx, cbuild, dispatch, gemv, panels


def torch_linear(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) @ wᵀ by ``F.linear`` (w widened to x2's dtype)."""
    return F.linear(x2, w if w.dtype is x2.dtype else w.to(x2.dtype))


def transposed(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) @ wᵀ as (w @ x2ᵀ)ᵀ (w widened to x2's dtype)."""
    return ((w if w.dtype is x2.dtype else w.to(x2.dtype)) @ x2.T).T.contiguous()


PATHS = {"kernel": gemv.gemv, "panels": panels.product, "linear": torch_linear, "transposed": transposed,
         "amx": amx.gemm}
APPLIES = {"kernel": gemv.applies, "panels": panels.applies, "amx": amx.applies}  # torch's paths take every product


def _candidates(w: torch.Tensor) -> dict[str, dispatch.At]:
    """Each path on copies of ``w`` (the kernel where it applies), for ``dispatch.measure``."""
    n = dispatch.copies(w.numel() * w.element_size())
    # each call reads another copy: from memory (held as n tensors that keep version counters, as a
    # model's weights do: the panels path keeps a packed copy per tensor)
    with torch.inference_mode(False):
        ws = list(w.detach().expand(n, *w.shape).contiguous())
    turn = itertools.count()

    def at(name):
        def rows(m):
            x = torch.randn(m, w.shape[1])
            if name in APPLIES and not APPLIES[name](x, ws[0]):
                return None
            if name == "panels":  # pack every copy now: the samples time products, not the one-time packing
                panels.prepare(ws)
            return lambda: PATHS[name](x, ws[next(turn) % n])
        return rows
    return {name: at(name) for name in PATHS}


PRODUCT = dispatch.Operation("product", tuple(PATHS), "linear", _candidates, scales=("linear", "transposed", "amx"))


def table(w: torch.Tensor) -> dispatch.Table:
    """The measured choice of path per row count for products with weights like ``w``."""
    return dispatch.lookup(PRODUCT, (*w.shape, w.dtype), w)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``codraft.models.layers.linear`` (``F.linear(x, w)``, no bias, one 2-D product, a narrower w
    widened) through the fastest path for its row count."""
    x2 = x.reshape(-1, x.shape[-1])
    path = torch_linear
    if cbuild.fits(x2) and cbuild.weight_fits(w):
        path = PATHS[table(w).path(x2.shape[0])]
    return path(x2, w).view(*x.shape[:-1], w.shape[0])
