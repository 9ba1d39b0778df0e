"""The precision a model trains in, fp32 or bf16 products (``codraft.models.bf16``: bf16 matrix products,
everything else fp32), chosen by measurement on the machine at hand. It applies to the policy's GRPO loss
(``grpo.precision``) and to the draft's loss (``draft.precision``, the offline recipes' ``precision``).

bf16 products pay where the processor multiplies bf16 natively: on a 2-core Sapphire-Rapids-class Xeon
(AMX), torch's bf16 products of a draft's training shapes run 2-4x faster than fp32, whole offline DSpark
and DFlash steps 1.2-1.3x, and SmolLM2's GRPO loss forward and backward ~1.3x (docs/real-preset.md). Where the processor only converts (AVX2), bf16 products should be slower (not yet
measured). So "auto" times the model's own products both ways, forward and backward, once per machine,
and caches the choice as JSON under ``cache_root()/precision/``, keyed by the products' shapes and
``cache.machine_key``; a file recorded elsewhere is never read (its name differs).

What changes under bf16: the products round their operands to bf16 (about 3 significant digits) and
accumulate in fp32. A draft's loss moves by ~1e-3 relative and its gradients by ~0.5 %, and held-out
acceptance after 300 offline steps is the same within 0.005 of tau_est; the policy's GRPO gradient moves
by ~3 % of its norm, and its logprobs drift from the rollout's by a KL the run logs (``rollout_kl``)
(tests/unit/test_precision.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from time import perf_counter

import torch
import torch.nn as nn

from codraft.atomic import atomic_write_text
from codraft.cache import cache_root, keyed_file, machine_key
from codraft.models.bf16 import products

PRECISIONS = ("auto", "float32", "bfloat16")
FORMAT = 3     # bump when what is timed changes: old files are measured again
ROWS = 1024    # rows of each timed product: a training step's supervised rows, about (a multiple of bf16.ROW_BUCKET)
MARGIN = 0.9   # bf16 is chosen only when it takes at most this share of fp32's time


def resolve(precision: str, model: nn.Module, *, what: str = "draft", folder: str | Path | None = None,
            timer=None) -> torch.dtype:
    """torch.float32 or torch.bfloat16 for ``precision`` ("auto": measured for ``model``'s trainable
    products, see the module docstring); ``what`` names the model in messages.
    timer(dtype, shapes, device) -> seconds replaces the measurement (tests)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{what} training precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return getattr(torch, precision)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return torch.float32
    device = params[0].device
    shapes = sorted({tuple(p.shape) for p in params if p.ndim == 2})
    if not shapes:
        return torch.float32
    folder = Path(folder) if folder is not None else cache_root() / "precision"
    key, path = keyed_file(folder, {"format": FORMAT, "shapes": shapes, "rows": ROWS, "torch": torch.__version__,
                                    "machine": machine_key(device)})
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key and saved["choice"] in ("float32", "bfloat16"):
            return getattr(torch, saved["choice"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent or unreadable: measure again
    print(f"{what} training precision=auto: timing its products in fp32 and bf16 on {device}, once for this "
          "machine ...", file=sys.stderr, flush=True)
    timer = timer or _time_products
    seconds = {name: timer(getattr(torch, name), shapes, device) for name in ("float32", "bfloat16")}
    choice = "bfloat16" if seconds["bfloat16"] <= MARGIN * seconds["float32"] else "float32"
    print(f"{what} training precision on {device}: fp32 {1e3 * seconds['float32']:.1f} ms, bf16 products "
          f"{1e3 * seconds['bfloat16']:.1f} ms -> {choice} (cached in {path})", file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "seconds": seconds, "choice": choice}, indent=1))
    return getattr(torch, choice)


def _time_products(dtype: torch.dtype, shapes, device: torch.device, repeats: int = 3) -> float:
    """Best of ``repeats`` passes (after a warm-up) of a forward and backward of x @ wᵀ for every shape,
    under ``products(dtype)``; fp32 inputs and weights, as a model keeps them. Each pass has a few rows
    fewer than the last, as training batches differ; under bf16 they pad to one bucket, which the warm-up
    compiles, as a training run compiles its few buckets in its first steps."""
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(o, i, generator=gen, device=device, requires_grad=True) for o, i in shapes]
    best = float("inf")
    for r in range(repeats + 1):
        xs = [torch.randn(ROWS - 7 * r, w.shape[1], generator=gen, device=device, requires_grad=True)
              for w in weights]
        _sync(device)
        t = perf_counter()
        for x, w in zip(xs, weights):
            with products(dtype):
                y = torch.nn.functional.linear(x, w)
            y.sum().backward()
        _sync(device)
        if r:
            best = min(best, perf_counter() - t)
    return best


def _sync(device: torch.device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
