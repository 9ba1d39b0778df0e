"""`codraft bench first-timing`: what a model's first decode costs on a machine that has no dispatch tables.

The first time a product shape or a decoder layer shape runs here, ``codraft.kernels.dispatch`` times its
candidate paths over row counts 1..128 and caches the choice (``$CODRAFT_CACHE/dispatch``); the timing
cycles through copies of the operands so they stream from memory (up to 256 MB), so it costs seconds and
memory once. This measures exactly that, for each table one decode step of the model looks up (each
distinct product shape, the LM head's included, and the one-call decoder layer: ``bench gemv``'s
``tables``), in a private, empty dispatch folder: the tables cached in ``$CODRAFT_CACHE`` are neither
read nor changed, and this process's own are put back afterwards. Per table: seconds, and the process's
peak resident memory (``ru_maxrss``) before and after; the peak only grows, so a table's rise is what it
needed beyond everything before it.
"""
from __future__ import annotations

import contextlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

from codraft.bench import format_table, machine_info
from codraft.bench.gemv import decode_weights
from codraft.bench.spec import MODELS
from codraft.kernels import dispatch, fast_layers, products
from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB (Linux reports KB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


@contextlib.contextmanager
def private_tables(folder: Path):
    """Within it, dispatch tables are looked up in ``folder/dispatch`` only and this process remembers none
    from before; on leaving, this process's tables are as they were."""
    saved = dict(dispatch.TABLES)
    dispatch.TABLES.clear()
    try:
        with mock.patch.object(dispatch, "cache_root", lambda: Path(folder)):
            yield
    finally:
        dispatch.TABLES.clear()
        dispatch.TABLES.update(saved)


def lookups(decoder) -> list[tuple[str, str, Callable[[], dispatch.Table]]]:
    """(op, what, the call that looks its table up) for each table a decode step of ``decoder`` uses."""
    out, seen = [], set()
    for w in decode_weights(decoder):
        key = (*w.shape, w.dtype)
        if key not in seen:
            seen.add(key)
            out.append(("product", dispatch.describe(key), lambda w=w: products.table(w)))
    layer = decoder.layers[0]
    if isinstance(layer, fast_layers.FastDecoderLayer) and layer.self_attn.q_norm is None:  # (as bench gemv)
        a = layer.self_attn
        what = (f"{a.q_proj.weight.shape[1]} hidden, {a.n_heads}/{a.n_kv} heads of {a.head_dim}, "
                f"{layer.mlp.gate_proj.weight.shape[0]} mlp")
        out.append(("layer", what, lambda: fast_layers.layer_table(layer)))
    return out


def measure(decoder, folder: Path) -> list[dict]:
    """Each of ``lookups(decoder)`` timed from an empty dispatch folder ``folder``: op, key, seconds, peak
    RSS before and after (MB), the ranges chosen and the busy cores the measurement saw."""
    rows = []
    with private_tables(folder), torch.inference_mode():
        for op, what, look_up in lookups(decoder):
            before = peak_rss_mb()
            t = time.perf_counter()
            table = look_up()
            rows.append({"op": op, "key": what, "seconds": time.perf_counter() - t, "peak_rss_mb_before": before,
                         "peak_rss_mb_after": peak_rss_mb(), "ranges": [list(r) for r in table.ranges],
                         "busy_cores": table.busy})
    return rows


def run(model_name: str = "smollm2", dtypes=("float32",), threads: int = 2, json_path: str | None = None) -> dict:
    torch.set_num_threads(threads)
    model = load_policy(MODELS.get(model_name, model_name))[0].eval()
    report = {"model": model_name, "threads": threads, "machine": machine_info(), "tables": []}
    for dtype in dtypes:
        decoder = RolloutWeights(model, getattr(torch, dtype)).policy  # placed as the engine decodes it
        with tempfile.TemporaryDirectory() as tmp:
            rows = measure(decoder, Path(tmp))
        report["tables"] += [{"dtype": dtype, **r} for r in rows]
        total = sum(r["seconds"] for r in rows)
        print(f"bench first-timing: {model_name}, {dtype} weights, {threads} threads, "
              f"{report['machine']['processor']}: {len(rows)} dispatch tables timed from nothing in {total:.1f} s; "
              f"peak RSS {rows[0]['peak_rss_mb_before']:.0f} -> {rows[-1]['peak_rss_mb_after']:.0f} MB")
        print(format_table([[r["op"], r["key"], r["seconds"], r["peak_rss_mb_before"], r["peak_rss_mb_after"],
                             ", ".join(f"{lo}-{hi} {p}" for lo, hi, p in r["ranges"])] for r in rows],
                           ["op", "shape", "s", "peak MB before", "after", "rows -> path"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return report
