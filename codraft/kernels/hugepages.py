"""Decode weights in 2 MB pages: ``rehome(tensors)`` moves them into one buffer the kernel backs with
transparent huge pages.

A decode step streams every weight once (SmolLM2: ~0.5 GB in fp32, 0.27 GB in bf16). In 4 KB pages
that is a TLB miss every 4 KB, and the hardware prefetchers stop at every page boundary; in 2 MB
pages they run on. On a 2-core EPYC (Zen 3) a SmolLM2 bf16 decode step at batch 1 ran ~10 %
faster with its weights here, and an fp32 one (the trainer's own weights) ~10 % faster (no gain was
measured before the kernels streamed faster; docs/history.md). The GEMV kernel's tuning is
timed on weights placed as the engine's are (``gemv.time_tuning``).

Linux only (``madvise``; transparent huge pages set to ``always`` or ``madvise``); elsewhere, or
when refused, the tensors still move into the one buffer and ``rehome`` says no huge pages were
granted. Every tensor becomes a view of the one buffer (``safetensors`` saves such views, which do
not overlap, as separate tensors).
Not here: which weights the engine decodes from (``codraft.rollout.weights``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import sys
from pathlib import Path

import torch

PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
ALIGN = 64  # each tensor starts on a cache line


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_bytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) backed by transparent huge pages now, from
    ``/proc/self/smaps`` (0 where it cannot be read)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    total, inside = 0, False
    for line in text.splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            inside = lo < address + nbytes and address < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) << 10
    return total


def rehome(tensors: list[torch.Tensor]) -> bool:
    """Copy CPU ``tensors`` into one fresh buffer, 2 MB aligned and advised for huge pages before its
    pages are touched, and point each one's ``.data`` at its view there (values, dtypes, shapes,
    ``requires_grad`` unchanged). Returns whether the kernel backed the buffer with huge pages."""
    if not tensors:
        return False
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("rehome takes CPU tensors")
    offsets, n = [], 0
    for t in tensors:
        offsets.append(n)
        n += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    n = -(-n // PAGE) * PAGE
    raw = torch.empty(n + PAGE, dtype=torch.uint8)  # untouched: the faults below get the advice
    start = -raw.data_ptr() % PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(raw.data_ptr() + start, n, MADV_HUGEPAGE)
    buffer = raw[start:start + n]
    for t, off in zip(tensors, offsets):
        view = buffer[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        t.data = view
    if madvise is None:
        return False
    huge = huge_bytes(buffer.data_ptr(), n)
    if huge < n // 2:  # faulted in small pages (e.g. memory fragmented)
        madvise(buffer.data_ptr(), n, MADV_COLLAPSE)  # best effort: Linux 6.1+
        huge = huge_bytes(buffer.data_ptr(), n)
    return huge > 0
