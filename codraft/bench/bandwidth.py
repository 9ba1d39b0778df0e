"""Memory bandwidth measured in-process, and the bandwidth bound of one decode step.

Batch-1 decoding reads every weight once per step, so ``weight bytes / bandwidth`` is a
floor on its time per step (KV-cache reads and activations add a little on top; weights that
fit in the last-level cache can beat it, so it only binds for models much larger than the cache).

The probe tensor is filled with random data first: an uninitialised ``torch.empty`` maps the
shared zero page and "reads" at cache speed. The destination of the copy is written once
before timing too, so page faults of a fresh allocation (what ``clone()`` of a cold tensor
pays) are not counted. Leaves out: NUMA placement, huge pages, non-temporal-store effects.
"""
from __future__ import annotations

from time import perf_counter

import torch

GiB = 1 << 30


def _best(fn, repeats: int) -> float:
    fn()  # warm: page-in, caches, thread pool
    best = float("inf")
    for _ in range(repeats):
        t = perf_counter()
        fn()
        best = min(best, perf_counter() - t)
    return best


def measure_bandwidth(nbytes: int = GiB, repeats: int = 5) -> dict:
    """Copy and read bandwidth in GB/s (1e9 B/s) of a random fp32 buffer of ``nbytes``, best of ``repeats``.

    copy counts bytes read + bytes written (2 x nbytes per pass), like STREAM's "copy";
    read is a sum reduction over the buffer (nbytes per pass).
    """
    if nbytes < 1 << 20:
        raise ValueError(f"nbytes={nbytes} is too small to leave the caches; use at least 1 MiB (ideally >= 1 GiB)")
    n = nbytes // 4
    src = torch.rand(n, generator=torch.Generator().manual_seed(0))  # real data, every page touched
    dst = torch.rand(n, generator=torch.Generator().manual_seed(1))
    t_copy = _best(lambda: dst.copy_(src), repeats)
    t_read = _best(lambda: src.sum(), repeats)
    del src, dst
    return {"bytes": n * 4, "repeats": repeats, "threads": torch.get_num_threads(),
            "copy_GBps": 2 * n * 4 / t_copy / 1e9, "read_GBps": n * 4 / t_read / 1e9}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (a tied embedding/LM head counts once) and persistent buffers."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_bound_s(nbytes: int, bandwidth_GBps: float) -> float:
    """Lower bound on one decode step's time: every weight byte read once at ``bandwidth_GBps``."""
    return nbytes / (bandwidth_GBps * 1e9)


if __name__ == "__main__":
    import json
    print(json.dumps(measure_bandwidth(), indent=2))
