"""bf16 weight matrices packed in panels (``gemv.c``'s ``pack_panels_bf16``): copies on which few-row
products run at up to the FMA rate, and products through them.

A decode product reads each weight once per step. In ``gemv.c``'s row-major kernel every output
ends in a horizontal sum and every FMA loads its own vector of the inputs; packed in panels of
2 × LANES output rows (for each input index, the panel's weights contiguous), one load serves a
panel's outputs and each input row is one broadcast: 1.1× at 1 row, 1.1–1.4× at 2–16 rows on a 2-core
EPYC (docs/bench-spec.md, "Weights packed in panels"). A copy is made on first use, in 2 MB pages,
and made again (into the same memory) whenever the weight's version counter or address changes (a
rollout copy's refresh, ``.data =``, any in-place op), so it is never stale. Only bf16 weights that
nothing trains (``requires_grad`` off: the rollout copies): torch's fused AdamW (the trainer's
optimiser) updates parameters without bumping their version counters (checked, torch 2.13), so a copy
of a trained weight could go stale unseen. Inference tensors keep no version counter. Both run
unpacked.
Used by the product dispatch (``codraft.kernels.products``, path ``panels``) and by the decode
stack's plans (``codraft.kernels.decode_ops``).
"""
from __future__ import annotations

import weakref

import torch

from codraft.kernels import cbuild, gemv, hugepages


def _lib():
    """The built library, its panel functions typed by ``gemv.kernel`` (the caller checked
    ``gemv.applies`` or ``decode_ops.kernels``: it is built)."""
    gemv.kernel()  # (cached: sets the functions' argument types on first use)
    return cbuild.library()


def empty(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Room for each weight's packed copy (its rows rounded up to whole panels), in one buffer of 2 MB
    pages when they fill one at least (smaller copies would each take a page of their own)."""
    rows = _lib().panel_rows()
    out = [torch.empty(-(-w.shape[0] // rows) * rows, w.shape[1], dtype=w.dtype) for w in weights]
    if sum(t.numel() * t.element_size() for t in out) >= hugepages.PAGE:
        hugepages.rehome(out)
    return out


def pack(w: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """Pack w (O,I) bf16, contiguous, into ``into`` (from ``empty``)."""
    _lib().pack_panels_bf16(w.data_ptr(), into.data_ptr(), *w.shape)
    return into


# id(weight) -> (a weak reference to it, stamp, its packed copy, (shape, dtype)); an entry goes when
# its weight does (a WeakKeyDictionary would compare tensors with ==, elementwise)
_copies: dict[int, tuple] = {}


def versions(weights: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The weights' version counters, by which packed copies of them follow them; None where a copy
    could not (see above: a weight that requires grad, or an inference tensor)."""
    try:
        return None if any(w.requires_grad for w in weights) else tuple(w._version for w in weights)
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def packed(w: torch.Tensor) -> torch.Tensor:
    """w's packed copy, made or brought up to date first (w: a weight ``versions`` accepts)."""
    stamp = (w.data_ptr(), w._version)
    held = _copies.get(id(w))
    if held is None or held[0]() is not w:
        weakref.finalize(w, _copies.pop, id(w), None)
        held = None
    if held is None or held[1] != stamp:
        room = held[2] if held is not None and held[3] == (w.shape, w.dtype) else empty([w])[0]
        held = _copies[id(w)] = (weakref.ref(w), stamp, pack(w, room), (w.shape, w.dtype))
    return held[2]


def prepare(weights: list[torch.Tensor]) -> None:
    """Make (or bring up to date) the packed copy of each bf16 weight ``versions`` accepts, now: a
    measurement cycling through many copies of a weight would otherwise time the packing (each
    copy's first product: ~10x the product at 1 row)."""
    for w in weights:
        if w.dtype is torch.bfloat16 and versions([w]) is not None:
            packed(w)


def applies(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """What ``gemv.applies`` takes, with a bf16 weight."""
    return w.dtype is torch.bfloat16 and gemv.applies(x2, w)


def product(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) fp32 @ wᵀ through w's packed copy -> (M,O) fp32 (a trainable weight or an inference
    tensor through ``gemv`` as it is: see above); the caller checked ``applies``."""
    if versions([w]) is None:
        return gemv.gemv(x2, w)
    return gemv.run(_lib().gemv_panels_bf16, x2, w, packed(w))

