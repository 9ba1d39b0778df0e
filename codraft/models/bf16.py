"""bf16 products for training: inside ``products(torch.bfloat16)`` every ``F.linear`` (``nn.Linear`` and
``layers.linear`` included) rounds its input and weight to bf16 and accumulates in fp32 (oneDNN's AMX
kernels on CPU, tensor cores on GPU), and hands its output on in the input's dtype. Everything else stays
as it was: norms, attention, softmax, losses, the fp32 master weights, their gradients and the optimiser.

Not ``torch.autocast``: autocast also runs attention (SDPA) and other matmuls in bf16 and passes bf16
activations on. On a 2-core Sapphire-Rapids-class Xeon, SmolLM2's GRPO loss forward and backward took
6.3 s with bf16 products, 7.7 s under autocast and 8.6 s in fp32; an offline DSpark step 0.60 / 0.63 /
0.74 s (docs/real-preset.md). Attention keeps fp32's precision, so context parallelism's
LSE merges see what they see in fp32.

Which precision a run trains in, measured per machine: ``codraft.train.precision``.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

ROW_BUCKET = 128  # on CPU, a product's rows are padded to a multiple of this (64 measured ~4 % slower: more shapes)

_local = threading.local()  # the dtypes of the ``products`` contexts entered on this thread, innermost last


def _entered() -> list:
    if not hasattr(_local, "dtypes"):
        _local.dtypes = []
    return _local.dtypes


def active() -> torch.dtype:
    """The products' dtype the innermost ``products`` context asks for (fp32 outside any)."""
    entered = _entered()
    return entered[-1] if entered else torch.float32


@contextlib.contextmanager
def products(dtype: torch.dtype):
    """Run the products inside in ``dtype``: torch.float32 (as they are; inside a bf16 context, back to
    fp32) or torch.bfloat16. Autograd records the bf16 products, so the backward runs them in bf16 too."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"training products run in float32 or bfloat16, got {dtype}")
    entered = _entered()
    entered.append(dtype)
    try:
        with _Bf16Linear() if dtype == torch.bfloat16 else contextlib.nullcontext():
            yield
    finally:
        entered.pop()


def recompute_alike():
    """``checkpoint(..., context_fn=recompute_alike)``: a checkpointed forward that the backward runs again,
    outside the ``products`` context it first ran in, runs its products in the same dtype."""
    return contextlib.nullcontext(), products(active())


class _Bf16Linear(torch.overrides.TorchFunctionMode):
    """``F.linear`` as ``_PaddedProduct`` (bf16 operands, an output in the input's dtype) plus the bias in
    fp32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear or active() != torch.bfloat16:
            return func(*args, **kwargs)
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if not x.numel() or not x.is_floating_point():
            return func(*args, **kwargs)
        if isinstance(w, DTensor):  # tensor parallelism: the same rounding, unpadded (DTensor runs the product)
            y = func(x.to(torch.bfloat16), w.to(torch.bfloat16)).to(x.dtype)
            return y if bias is None else y + bias.to(y.dtype)
        y = _PaddedProduct.apply(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias.to(y.dtype)


class _PaddedProduct(torch.autograd.Function):
    """x (M,K) @ wᵀ with x and w rounded to bf16, fp32 accumulation, the result in x's dtype; gradients in
    x's and w's dtypes from bf16 products. On CPU the M rows are padded with zeros to a multiple of
    ``ROW_BUCKET`` (the output gradient's too): torch's bf16 products go to oneDNN, which compiles a kernel
    for every new shape (~10 ms, ~30 ms for a product's forward and backward), and a training batch's row
    counts change with every step; unpadded, bf16 lost to fp32 on whole draft steps (0.98 against 0.90 s).
    The padding rows are zeros and are dropped, so the kept rows and the gradients are the unpadded
    product's. Rounding and padding happen in one copy, the backward's too: bit for bit the gradients of
    autograd through F.pad, casts and a slice, 4 % faster on SmolLM2's GRPO train part (6.57 against
    6.85 s)."""

    @staticmethod
    def forward(ctx, x, w):
        xb, wb = _padded(x), w.to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.rows, ctx.dtypes = x.shape[0], (x.dtype, w.dtype)
        return torch.mm(xb, wb.T)[:ctx.rows].to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xb, wb = ctx.saved_tensors
        gb = _padded(grad)
        gx = torch.mm(gb, wb)[:ctx.rows].to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gw = torch.mm(gb.T, xb).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gx, gw


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t (M,K) in bf16, on CPU with zero rows up to a multiple of ROW_BUCKET: one copy."""
    rows = t.shape[0]
    pad = -rows % ROW_BUCKET if t.device.type == "cpu" else 0
    if not pad:
        return t.to(torch.bfloat16)
    out = t.new_empty((rows + pad, t.shape[1]), dtype=torch.bfloat16)
    out[:rows].copy_(t)
    out[rows:].zero_()
    return out
