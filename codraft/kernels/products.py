"""Few-row products ``x @ wᵀ`` on CPU: the fast ``linear`` the kernel-enabled layers use.

Up to ``gemv.KERNEL_ROWS`` rows (CPU, fp32, no autograd) the C kernel (``codraft.kernels.gemv``);
beyond that MKL's ``x @ wᵀ`` (what ``F.linear`` runs) is still slow up to ``SMALL_ROWS`` rows,
where the same product computed as ``(w @ xᵀ)ᵀ`` is faster; bigger batches, autograd and other
devices keep ``F.linear``. Outputs match ``F.linear`` up to fp32 summation order.
Not here: the kernel itself, and which modules use this (``codraft.kernels.fast_layers``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from codraft.kernels import gemv

SMALL_ROWS = 128  # up to here (w @ xᵀ)ᵀ beats F.linear on CPU (figures: docs/bench-spec.md)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``codraft.models.layers.linear`` (``F.linear(x, w)``, no bias, one 2-D product) through the
    fastest product for its row count."""
    x2 = x.reshape(-1, x.shape[-1])
    y = gemv.gemv(x2, w) if gemv.applies(x2, w) else torch_product(x2, w)
    return y.view(*x.shape[:-1], w.shape[0])


def torch_product(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) @ wᵀ with torch's own products: (w @ xᵀ)ᵀ for 2..SMALL_ROWS rows on CPU without grad."""
    if 2 <= x2.shape[0] <= SMALL_ROWS and x2.device.type == "cpu" and not torch.is_grad_enabled():
        return (w @ x2.T).T.contiguous()
    return F.linear(x2, w)
