"""Few-row products on CPU through a small C kernel (``gemv.c``), built on first use: fp32
activations times fp32 or bf16 weights, fp32 out.

Decoding multiplies each weight matrix by 1..γ+1 rows per sequence, so its speed is how fast
the weights stream from memory. ``gemv.c`` reads every weight row from memory once and dots it
with every input row (one or two weight rows by up to 6 input rows at a time) from L1: about
torch's speed at 1-2 rows, up to 2x it at 4-8. bf16 weights (the rollout engine's weight-only
bf16 copy) stream half the bytes, ~2x faster at 1 row, less as the rows make it compute-bound;
each is widened to fp32 exactly and the sums are fp32, so the result is
``F.linear(x, w.float())`` up to fp32 summation order.

``gemv.c`` also holds the products on bf16 weights packed in panels (``pack_panels_bf16``,
``gemv_panels_bf16``; ``codraft.kernels.panels``), which run 2-16 rows at up to the FMA rate.

How each of the three (fp32 and bf16 weights as they are, bf16 in panels: ``KINDS``) streams its
weights is measured the first time the kernel is used on a machine (``tuning``, a few seconds: 128
MB of weights at 1-16 rows, each setting) and cached with the dispatch tables, keyed by the CPU, the
thread count and the built library: whether it prefetches the weights ahead of the rows it reads
into L1, into L2 or not at all (the hardware prefetchers alone), and, for weights as they are, from
how many input rows it takes weight rows in pairs (each block of the inputs loaded once for two
weight rows: fewer loads per FMA where the rows make it compute-bound) rather than one at a time
(one address range streamed: faster at 1-3 rows on a 2-core EPYC).

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
from codraft.kernels import cbuild, hugepages

TUNING_FORMAT = 4  # bump when what is timed changes: older choices are measured again
PREFETCH_MODES = ("L1", "L2", "none")  # gemv.c's prefetch_mode 0, 1, 2
TUNE_ROWS = (1, 2, 3, 4, 5, 6, 8, 16)  # input rows timed
DTYPES = ("float32", "bfloat16")  # weight dtypes
KINDS = (*DTYPES, "panels")  # what is tuned, in the C tables' order: weights as they are, bf16 in panels
NEVER = 1 << 30  # pair_rows: weight rows one at a time at every row count


@functools.cache
def kernel() -> dict | None:
    """The C functions by weight dtype (fp32, bf16), or None (``CODRAFT_KERNELS=0``, or they
    could not be built: warned once). The kernel's tuning is set on first use (``tuning``)."""
    lib = cbuild.library()
    if lib is None:
        return None
    fns = {torch.float32: lib.gemv_rows, torch.bfloat16: lib.gemv_rows_bf16}
    for fn in (*fns.values(), lib.gemv_panels_bf16):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.pack_panels_bf16.argtypes, lib.pack_panels_bf16.restype = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2, None
    lib.panel_rows.argtypes, lib.panel_rows.restype = [], ctypes.c_int
    lib.set_tuning.argtypes, lib.set_tuning.restype = [ctypes.c_int] * 4, None
    lib.get_prefetch.argtypes, lib.get_prefetch.restype = [ctypes.c_int] * 2, ctypes.c_int
    lib.get_pair_rows.argtypes, lib.get_pair_rows.restype = [ctypes.c_int], ctypes.c_int
    apply(lib, tuning(lib, fns))
    return fns


def apply(lib, tune: dict) -> None:
    """Set a ``tuning`` (``{kind: setting}``, any of ``KINDS``) on the built library."""
    for name, t in tune.items():
        lib.set_tuning(KINDS.index(name), PREFETCH_MODES.index(t["prefetch"]),
                       PREFETCH_MODES.index(t["prefetch_pairs"]), min(t["pair_rows"], NEVER))


def setting(prefetch: str, pair_rows: int, prefetch_pairs: str | None = None) -> dict:
    """One weight dtype's tuning: weight rows in pairs from ``pair_rows`` input rows on, prefetched per
    ``prefetch_pairs`` (default: as below that), one at a time below, prefetched per ``prefetch``."""
    return {"prefetch": prefetch, "prefetch_pairs": prefetch_pairs or prefetch, "pair_rows": pair_rows}


def current(lib) -> dict:
    """The tuning the library runs with now."""
    return {name: setting(PREFETCH_MODES[lib.get_prefetch(i, 0)], lib.get_pair_rows(i),
                          PREFETCH_MODES[lib.get_prefetch(i, 1)]) for i, name in enumerate(KINDS)}


def _tuning_file(lib) -> tuple[Path, dict]:
    key = {"format": TUNING_FORMAT, "cpu_id": hashlib.sha256(cbuild._cpu_id().encode()).hexdigest()[:16],
           "threads": torch.get_num_threads(), "kernels": Path(lib._name).name}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "dispatch" / f"gemv-tuning-{name}.json", key


def tuning(lib, fns) -> dict:
    """``{kind: setting(...)}`` for this machine: read from the cache, else timed
    (``time_tuning``), chosen (``choose``, per kind) and cached. A file for another key, or
    unreadable, is timed again."""
    path, key = _tuning_file(lib)
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            tune = {name: setting(t["prefetch"], int(t["pair_rows"]), t["prefetch_pairs"])
                    for name, t in ((n, saved["tuning"][n]) for n in KINDS)}
            if all(t["prefetch"] in PREFETCH_MODES and t["prefetch_pairs"] in PREFETCH_MODES for t in tune.values()):
                return tune
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"codraft: timing the GEMV kernel's prefetch and weight-row pairing ({key['threads']} threads)…",
          file=sys.stderr, flush=True)
    ms = time_tuning(lib, fns)
    tune = {name: choose({k[1:]: t for k, t in ms.items() if k[0] == name}) for name in KINDS}
    path.parent.mkdir(parents=True, exist_ok=True)
    table = [{"dtype": d, "prefetch": m, "pairs": p, "rows": r, "ms": t} for (d, m, p, r), t in ms.items()]
    atomic_write_text(path, json.dumps({"key": key, "tuning": tune, "ms": table}, indent=1))
    return tune


def choose(ms: dict[tuple[str, bool, int], float]) -> dict:
    """From {(prefetch mode, in pairs, rows): ms} of one kind, the pairing threshold and the
    prefetch mode on each side of it with the least total time over the timed row counts, each row
    count's time relative to its fastest (so many-row passes do not outweigh the rest). Timed without
    pairs only (panels): the mode alone, never paired."""
    rows = sorted({r for _, _, r in ms})
    best = {r: min(t for (_, _, rr), t in ms.items() if rr == r) for r in rows}

    def side(pairs: bool, counts: list[int]) -> tuple[float, str]:  # (cost, mode) of the best mode there
        return min((sum(ms[m, pairs, r] / best[r] for r in counts), m) for m in PREFETCH_MODES)
    if not any(pairs for _, pairs, _ in ms):
        return setting(side(False, rows)[1], NEVER)

    def total(p: int) -> float:
        return side(False, [r for r in rows if r < p])[0] + side(True, [r for r in rows if r >= p])[0]
    pair_rows = min([*rows, NEVER], key=total)
    return setting(side(False, [r for r in rows if r < pair_rows])[1], pair_rows,
                   side(True, [r for r in rows if r >= pair_rows])[1])


def time_tuning(lib, fns, nbytes: int = 128 << 20, rounds: int = 3) -> dict[tuple[str, str, bool, int], float]:
    """{(kind, prefetch mode, weight rows in pairs, input rows): ms}: the best of ``rounds`` passes
    (the settings alternate) over ``nbytes`` of 1536x576 weights streamed from memory as in a decode
    step: placed as the engine's are, fp32 (the trainer's own), bf16 (the rollout copy) and its copies
    packed in panels alike in 2 MB pages (``hugepages.rehome``, ``codraft.rollout.weights``). Panels
    are timed without pairs (they have none)."""
    best = {}
    saved = current(lib)
    gen = torch.Generator().manual_seed(0)  # not the global RNG: a run tuning midway samples as one that did not
    try:
        for name in KINDS:
            w = torch.ones(1536, 576, dtype=torch.float32 if name == "float32" else torch.bfloat16)
            ws = [w.clone() for _ in range(max(2, nbytes // (w.numel() * w.element_size())))]
            hugepages.rehome(ws)
            fn = fns[w.dtype]
            if name == "panels":  # 1536 rows: whole panels at any vector width, so a copy has w's shape
                fn = lib.gemv_panels_bf16
                for wi in ws:
                    lib.pack_panels_bf16(w.data_ptr(), wi.data_ptr(), *w.shape)
            for m in TUNE_ROWS:
                x, y = torch.randn(m, 576, generator=gen), torch.empty(m, 1536)
                for _ in range(rounds):
                    for mode in PREFETCH_MODES:
                        for pairs in (False, True) if name != "panels" else (False,):
                            apply(lib, {name: setting(mode, 1 if pairs else NEVER)})
                            t = perf_counter()
                            for wi in ws:
                                fn(x.data_ptr(), wi.data_ptr(), y.data_ptr(), m, 576, 1536)
                            t = (perf_counter() - t) * 1e3
                            key = (name, mode, pairs, m)
                            best[key] = min(best.get(key, t), t)
    finally:
        apply(lib, saved)
    return best


def applies(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemv`` can take this product, at any row count: CPU, x2 fp32, w fp32 or bf16 and
    contiguous, no autograd, kernel built."""
    return cbuild.fits(x2) and cbuild.weight_fits(w) and kernel() is not None


def gemv(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 (M,I) fp32 @ wᵀ (O,I) fp32 or bf16 -> (M,O) fp32 through the kernel; the caller checked
    ``applies``."""
    return run(kernel()[w.dtype], x2, w, w)


def run(fn, x2: torch.Tensor, w: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y (M,O) fp32 = x2 (M,I) @ wᵀ (O,I) by the C function ``fn(x, weights, y, M, I, O)``, which reads
    ``weights`` (w, or a copy of it in another layout)."""
    m, i = x2.shape
    o = w.shape[0]
    if w.shape[1] != i:
        raise ValueError(f"shape mismatch: x {tuple(x2.shape)} @ w {tuple(w.shape)}ᵀ")
    x2 = x2.contiguous()
    y = torch.empty(m, o)
    fn(x2.data_ptr(), weights.data_ptr(), y.data_ptr(), m, i, o)
    return y
