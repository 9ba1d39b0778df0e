"""Few-row products on CPU through a small C kernel (``gemv.c``), built on first use: fp32
activations times fp32 or bf16 weights, fp32 out.

Decoding multiplies each weight matrix by 1..γ+1 rows per sequence, so its speed is how fast
the weights stream from memory. ``gemv.c`` reads every weight row from memory once (prefetched)
and dots it with the input rows (two weight rows by 4 input rows at a time) from L1: about
torch's speed at 1-2 rows, up to 2x it at 4-8. bf16 weights (the rollout engine's weight-only
bf16 copy) stream half the bytes, ~2x faster at 1 row, less as the rows make it compute-bound;
each is widened to fp32 exactly and the sums are fp32, so the result is
``F.linear(x, w.float())`` up to fp32 summation order.

The kernel prefetches the weights ahead of the rows it reads, into L1 or into L2: whichever
streams faster here is measured the first time the kernel is used on a machine (~0.5 s: a pass
over 256 MB of bf16 and fp32 weights at 1 and 4 rows with each hint) and cached with the dispatch
tables, keyed by the CPU, the thread count and the built library (``prefetch_to_l2``).

Built on first use by ``codraft.kernels.cbuild``; it runs on OpenMP, i.e. torch's own thread
pool, so ``torch.set_num_threads`` applies. No compiler, or ``CODRAFT_KERNELS=0``: ``kernel()``
is None (with a warning, none for the opt-out). ``applies`` says whether the kernel *can* take a
product, at any row count; not here: whether it is the fastest for that row count
(``codraft.kernels.products``).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import sys
from pathlib import Path
from time import perf_counter

import torch

from codraft.atomic import atomic_write_text
from codraft.cache import cache_root
from codraft.kernels import cbuild

PREFETCH_FORMAT = 1  # bump when what is timed changes: older choices are measured again


@functools.cache
def kernel() -> dict | None:
    """The C functions by weight dtype (fp32, bf16), or None (``CODRAFT_KERNELS=0``, or they
    could not be built: warned once). The prefetch hint is set on first use (``prefetch_to_l2``)."""
    lib = cbuild.library()
    if lib is None:
        return None
    fns = {torch.float32: lib.gemv_rows, torch.bfloat16: lib.gemv_rows_bf16}
    for fn in fns.values():
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.set_prefetch_l2.argtypes, lib.set_prefetch_l2.restype = [ctypes.c_int], None
    lib.set_prefetch_l2(int(prefetch_to_l2(lib, fns)))
    return fns


def _prefetch_file(lib) -> tuple[Path, dict]:
    key = {"format": PREFETCH_FORMAT, "cpu_id": hashlib.sha256(cbuild._cpu_id().encode()).hexdigest()[:16],
           "threads": torch.get_num_threads(), "kernels": Path(lib._name).name}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "dispatch" / f"prefetch-{name}.json", key


def prefetch_to_l2(lib, fns) -> bool:
    """Whether the kernel should prefetch weights into L2 rather than L1 here: read from the cache,
    else timed (``time_prefetch``) and cached. A file for another key, or unreadable, is timed again."""
    path, key = _prefetch_file(lib)
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return bool(saved["l2"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"codraft: timing the GEMV kernel's prefetch into L1 and L2 ({key['threads']} threads)…",
          file=sys.stderr, flush=True)
    ms = time_prefetch(lib, fns)
    l2 = ms["L2"] < ms["L1"]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "l2": l2, "ms": ms}, indent=1))
    return l2


def time_prefetch(lib, fns, nbytes: int = 256 << 20, rounds: int = 5) -> dict[str, float]:
    """{"L1": ms, "L2": ms}: the best of ``rounds`` passes (the hints alternate) over ``nbytes`` of
    1536x576 weights, streamed from memory as in a decode step, summed over bf16 and fp32 weights and
    1 and 4 rows."""
    best = {"L1": 0.0, "L2": 0.0}
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.ones(1536, 576, dtype=dtype)
        ws = [w.clone() for _ in range(max(2, nbytes // (w.numel() * w.element_size())))]
        for m in (1, 4):
            x, y = torch.randn(m, 576), torch.empty(m, 1536)
            times = {"L1": [], "L2": []}
            for _ in range(rounds):
                for hint in times:
                    lib.set_prefetch_l2(int(hint == "L2"))
                    t = perf_counter()
                    for wi in ws:
                        fns[dtype](x.data_ptr(), wi.data_ptr(), y.data_ptr(), m, 576, 1536)
                    times[hint].append(perf_counter() - t)
            for hint, ts in times.items():
                best[hint] += min(ts) * 1e3
    return best


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
