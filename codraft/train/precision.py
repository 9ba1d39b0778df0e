"""The precision a draft trains in: fp32, or bf16 autocast (bf16 products, fp32 master weights,
optimiser and losses), chosen by measurement on the machine at hand.

bf16 products pay where the processor multiplies bf16 natively: on a 2-core Sapphire-Rapids-class
Xeon (AMX), torch's bf16 products of a draft's training shapes run 2-4x faster than fp32, and whole
offline DSpark and DFlash steps 1.2-1.3x (docs/real-preset.md, session 29). Where the processor only
converts (AVX2), bf16 products are slower. So "auto" times the draft's own products both ways, forward
and backward, once per machine, and caches the choice as JSON under ``cache_root()/precision/``, keyed by
the products' shapes and ``cache.machine_key``; a file recorded elsewhere is never read (its name differs).

What changes under bf16: the draft's matrix products round their inputs to bf16 (about 3 significant
digits) and accumulate in fp32; its losses are computed in fp32 from those logits (``slot_losses``
promotes them), so the loss moves by ~1e-3 relative and the gradients by ~0.5 %, and held-out acceptance
after 300 steps is the same within 0.005 of tau_est (tests/test_precision.py; the session-29 notes).
The policy never trains under it: the draft sees the policy's detached features only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path
from time import perf_counter

import torch
import torch.nn as nn

from codraft.atomic import atomic_write_text
from codraft.cache import cache_root, machine_key

PRECISIONS = ("auto", "float32", "bfloat16")
FORMAT = 2     # bump when what is timed changes: old files are measured again
ROWS = 1024    # rows of each timed product: a training step's supervised rows, about (a ROW_BUCKET multiple)
MARGIN = 0.9   # bf16 is chosen only when it takes at most this share of fp32's time


def resolve(precision: str, draft: nn.Module, *, folder: str | Path | None = None, timer=None) -> torch.dtype:
    """torch.float32 or torch.bfloat16 for ``precision`` ("auto": measured, see the module docstring).
    timer(dtype, shapes, device) -> seconds replaces the measurement (tests)."""
    if precision not in PRECISIONS:
        raise ValueError(f"draft training precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return getattr(torch, precision)
    params = [p for p in draft.parameters() if p.requires_grad]
    if not params:
        return torch.float32
    device = params[0].device
    shapes = sorted({tuple(p.shape) for p in params if p.ndim == 2})
    if not shapes:
        return torch.float32
    key = {"format": FORMAT, "shapes": shapes, "rows": ROWS, "torch": torch.__version__, "machine": machine_key(device)}
    key = json.loads(json.dumps(key))  # as JSON reads it back
    folder = Path(folder) if folder is not None else cache_root() / "precision"
    path = folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key and saved["choice"] in ("float32", "bfloat16"):
            return getattr(torch, saved["choice"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent or unreadable: measure again
    timer = timer or _time_products
    seconds = {name: timer(getattr(torch, name), shapes, device) for name in ("float32", "bfloat16")}
    choice = "bfloat16" if seconds["bfloat16"] <= MARGIN * seconds["float32"] else "float32"
    print(f"draft training precision on {device}: fp32 {1e3 * seconds['float32']:.1f} ms, bf16 autocast "
          f"{1e3 * seconds['bfloat16']:.1f} ms for the draft's products -> {choice}", file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "seconds": seconds, "choice": choice}, indent=1))
    return getattr(torch, choice)


def autocast(dtype: torch.dtype, device: torch.device):
    """The context a draft's forward (its loss) runs in at ``dtype``: nothing for fp32; for bf16, autocast,
    on CPU with every ``F.linear`` input padded to a multiple of ``ROW_BUCKET`` rows (``_BucketedRows``)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=dtype))
    if device.type == "cpu":  # oneDNN's per-shape kernels; GPU libraries need no padding
        stack.enter_context(_BucketedRows())
    return stack


ROW_BUCKET = 128  # rows a bf16 product's input is padded to a multiple of (64 measured ~4 % slower: more shapes)


class _BucketedRows(torch.overrides.TorchFunctionMode):
    """Pads the rows of every ``F.linear`` input (``nn.Linear`` included) with zeros to a multiple of
    ``ROW_BUCKET`` and drops the extra output rows. On CPU, torch's bf16 products go to oneDNN, which
    compiles a kernel for each new shape: ~10 ms, ~30 ms for a product's forward and backward, against
    ~20 ms for the whole product of 1 000 × 576 × 1 536. A draft's row counts change with every batch
    (sequence lengths, anchors), so unpadded they would compile at every step and bf16 would lose to
    fp32 (measured: 0.98 against 0.90 s a DSpark step). Padded, a run meets a few dozen shapes, each
    compiled once. The padding rows are zeros and are sliced off: the kept rows are exactly the
    unpadded product's, and so are the gradients (the padding's output gradient is zero)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func is torch.nn.functional.linear and x.dim() >= 2 and x.numel():
            rows = x.numel() // x.shape[-1]
            pad = -rows % ROW_BUCKET
            if pad:
                flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))
                y = func(flat, *args[1:], **kwargs)[:rows]
                return y.reshape(*x.shape[:-1], y.shape[-1])
        return func(*args, **kwargs)


def _time_products(dtype: torch.dtype, shapes, device: torch.device, repeats: int = 3) -> float:
    """Best of ``repeats`` passes (after a warm-up) of a forward and backward of x @ wᵀ for every shape,
    at ``dtype`` under ``autocast``; fp32 inputs and weights, as the draft keeps them. Each pass has a
    few rows fewer than the last, as a draft's batches differ; under bf16 they pad to one bucket, which
    the warm-up compiles, as a training run compiles its few buckets in its first steps."""
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(o, i, generator=gen, device=device, requires_grad=True) for o, i in shapes]
    best = float("inf")
    for r in range(repeats + 1):
        xs = [torch.randn(ROWS - 7 * r, w.shape[1], generator=gen, device=device, requires_grad=True)
              for w in weights]
        _sync(device)
        t = perf_counter()
        for x, w in zip(xs, weights):
            with autocast(dtype, device):
                y = torch.nn.functional.linear(x, w)
            y.float().sum().backward()
        _sync(device)
        if r:
            best = min(best, perf_counter() - t)
    return best


def _sync(device: torch.device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
