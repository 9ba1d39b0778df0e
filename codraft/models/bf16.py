"""bf16 products for training: inside ``products(torch.bfloat16)`` every ``F.linear`` (``nn.Linear`` and
``layers.linear`` included) rounds its input and weight to bf16 and accumulates in fp32 (oneDNN's AMX
kernels on CPU, tensor cores on GPU), and hands its output on in the input's dtype. Everything else stays
as it was: norms, attention, softmax, losses, the fp32 master weights, their gradients and the optimiser.

Not ``torch.autocast``: autocast also runs attention (SDPA) and other matmuls in bf16 and passes bf16
activations on. On a 2-core Sapphire-Rapids-class Xeon, SmolLM2's GRPO loss forward and backward took
6.3 s with bf16 products, 7.7 s under autocast and 8.6 s in fp32; an offline DSpark step 0.60 / 0.63 /
0.74 s (docs/real-preset.md, session 30). Attention keeps fp32's precision, so context parallelism's
LSE merges see what they see in fp32.

Which precision a run trains in, measured per machine: ``codraft.train.precision``.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

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
    """``F.linear`` with bf16 operands and an output in the input's dtype (a bias is added in fp32).

    On CPU the input's rows are padded with zeros to a multiple of ``ROW_BUCKET``: torch's bf16 products go
    to oneDNN, which compiles a kernel for every new shape (~10 ms, ~30 ms for a product's forward and
    backward), and a training batch's row counts change with every step; unpadded, bf16 lost to fp32 on
    whole draft steps (0.98 against 0.90 s). The padding rows are sliced off, so the kept rows and the
    gradients are the unpadded product's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear or active() != torch.bfloat16:
            return func(*args, **kwargs)
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not rows or not x.is_floating_point():
            return func(*args, **kwargs)
        flat = x.reshape(rows, x.shape[-1])
        pad = -rows % ROW_BUCKET if x.device.type == "cpu" else 0
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        y = func(flat.to(torch.bfloat16), w.to(torch.bfloat16))[:rows].to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])
