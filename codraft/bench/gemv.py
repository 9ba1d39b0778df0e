"""`codraft bench gemv`: how fast a model's weights stream through few-row products, path by path,
and whether the measured dispatch table picks well.

First the dispatch tables of the model's shapes on this machine (``codraft.kernels.dispatch``:
row range -> path, per product shape and for the one-call decoder layer; measured now if this
machine has none, or with ``remeasure``). Then, for each row count, the same run times,
interleaved, every 2-D weight a decode step multiplies (all layers' projections and the LM head, in
forward order): a ``sum`` over each weight (what reading it costs, the floor), each single product
path (``codraft.kernels.products.PATHS``: the C kernel, ``F.linear``, ``(w @ xᵀ)ᵀ``, the AMX kernel
for bf16 weights where the CPU has it) and the chosen one: the path each weight takes in a decode
step (``engine_paths``: a layer's products follow the one-call layer where its table picks it,
else each product's own table, as the LM head's), called the same way. Figures are ms for all the
products (best of ``repeats``) and GB/s of weights read.

"chosen vs best" (≥ 1: the table did as well as any single path at that row count) compares
within rounds: every round runs each side once, back to back in a rotating order, so a slow moment
of the shared host hits the sides of one round alike. Per single path p, the median over rounds of
p's time / the chosen one's in the same round; the figure is the lowest of those medians, the path
it belongs to is "best single". (A best-of-n time per side, compared across sides, mixes moments:
with four single paths against one chosen, the minimum over more samples wins by chance, and one
path timed twice came out 0.86× of itself on a host whose speed moved ±15 % within minutes.) The
same ratio for ``chosen_again`` (the chosen paths timed a second time in each round) shows the
noise: ``same_path``. Where every weight's chosen path is the best single path itself
(``chosen_is``), the ratio compares one code with itself: the summary counts those row counts apart.
``dtypes``: the fp32 weights and/or the bf16 rollout copy (weight-only: x stays fp32).

Products alone do not judge the one-call layer: it also does the norms, RoPE, attention and the
glue between them in C, so its products can lose to MKL's while its layer wins. So last, at
``step_rows``, whole decode steps (``measure_steps``: m rows of one new token over ``CONTEXT``
cached ones) run as the engine chooses and with each path forced everywhere (``dispatch.forcing``:
one product path for every product with the layers per op, or one variant of the one-call layer),
compared the same way within rounds.
"""
from __future__ import annotations

import functools
import json
import statistics
from collections import Counter
from time import perf_counter
from typing import Callable

import torch

from codraft.bench import format_table
from codraft.bench.spec import MODELS
from codraft.kernels import dispatch, fast_layers, products
from codraft.kernels.fast_layers import FUSED, FastDecoderLayer, layer_table
from codraft.models.kv_cache import KVCache
from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights

SINGLE = tuple(products.PATHS)
STEP_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64)
CONTEXT = 64  # cached tokens per row before a timed whole step
FUSED_PRODUCTS = {"fused": "kernel", "fused-panels": "panels", "fused-amx": "amx"}  # a one-call layer's products


def decode_weights(model) -> list[torch.Tensor]:
    """The weights one decode step multiplies, in forward order (a tied LM head once, last)."""
    ws = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        ws += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
               m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    return [w.detach() for w in ws] + [model.head_weight.detach()]


def tables(model, weights: list[torch.Tensor]) -> list[dict]:
    """The dispatch tables the model's decode steps use here: one per product shape (with how many
    weights share it) and, for layers without q/k norms, the one-call layer's."""
    shapes: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        shapes.setdefault((*w.shape, w.dtype), []).append(w)
    with torch.inference_mode():
        out = [{"op": "product", "key": dispatch.describe(key), "weights": len(ws), "table": products.table(ws[0])}
               for key, ws in shapes.items()]
        layer = model.layers[0]
        if layer.self_attn.q_norm is None:
            a = layer.self_attn
            key = (f"{a.q_proj.weight.shape[1]} hidden, {a.n_heads}/{a.n_kv} heads of {a.head_dim}, "
                   f"{layer.mlp.gate_proj.weight.shape[0]} mlp, {str(a.q_proj.weight.dtype).removeprefix('torch.')}")
            out.append({"op": "layer", "key": key, "weights": len(model.layers), "table": layer_table(layer)})
    return out


def engine_paths(model, weights: list[torch.Tensor], m: int) -> list[str]:
    """The path each of ``decode_weights(model)`` takes in a decode step of m rows: a layer's products
    run inside the one-call layer where its table picks that (the vector kernel, panels or AMX tiles),
    else each product takes its own table's path, as the LM head does."""
    layer, in_layers = model.layers[0], 7 * len(model.layers)
    fused = None
    if isinstance(layer, FastDecoderLayer) and layer.self_attn.q_norm is None:
        fused = FUSED_PRODUCTS.get(layer_table(layer).path(m))
    return [fused if fused and i < in_layers else products.table(w).path(m) for i, w in enumerate(weights)]


def measure(weights: list[torch.Tensor], rows: list[int], repeats: int = 9,
            paths: Callable[[int], list[str]] | None = None) -> list[dict]:
    """Per row count: ``{side}_ms`` for all ``weights``' products, sides: ``sum``, each path of
    ``products.PATHS`` (None where it does not apply), ``chosen`` (``paths(m)``, default each weight's
    product table; called as the single paths are) and ``chosen_again``; and ``best_single``,
    ``chosen_vs_best``, ``vs_chosen``, ``same_path``, ``chosen_paths`` (how many weights take each),
    ``chosen_is`` (the one path every weight takes, else None),
    ``bytes``, ``chosen_GBps``."""
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out = []
    with torch.inference_mode():
        for m in rows:
            xs = [torch.randn(m, w.shape[1]) for w in weights]  # (the same x for every side)
            assigned = paths(m) if paths else [products.table(w).path(m) for w in weights]
            chosen = [products.PATHS[n] for n in assigned]
            sides = {name: [fn] * len(weights) for name, fn in {"sum": lambda x, w: w.sum(), **products.PATHS}.items()}
            sides["chosen"] = sides["chosen_again"] = chosen
            for name, applies in products.APPLIES.items():
                if not all(applies(x, w) for x, w in zip(xs, weights)):
                    del sides[name]
            times = rounds({name: functools.partial(_each, fns, xs, weights) for name, fns in sides.items()}, repeats)
            ms = {n: min(times[n]) * 1e3 if n in times else None for n in ("sum", *SINGLE, "chosen", "chosen_again")}
            vs = {n: paired_ratio(times[n], times["chosen"]) for n in SINGLE if n in times}
            single = min(vs, key=vs.get)
            out.append({"rows": m, "bytes": nbytes, **{f"{k}_ms": v for k, v in ms.items()}, "best_single": single,
                        "chosen_vs_best": vs[single], "vs_chosen": vs, "chosen_paths": dict(Counter(assigned)),
                        "chosen_is": assigned[0] if len(set(assigned)) == 1 else None,
                        "same_path": paired_ratio(times["chosen_again"], times["chosen"]),
                        "chosen_GBps": nbytes / ms["chosen"] / 1e6})
    return out


def _each(fns, xs, weights):
    for fn, x, w in zip(fns, xs, weights):
        fn(x, w)


def rounds(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """{side: seconds per round}: ``repeats`` rounds (after one that warms up), each calling every
    side once in a rotating order, so a slow moment of the host hits the sides of a round alike."""
    times, names = {name: [] for name in sides}, list(sides)
    for r in range(repeats + 1):
        for k in range(len(names)):
            name = names[(k + r) % len(names)]
            t = perf_counter()
            sides[name]()
            if r:
                times[name].append(perf_counter() - t)
    return times


def step_sides(decoder, m: int, cache_k: torch.Tensor) -> dict[str, dict[str, str]]:
    """The ways a decode step of m rows can run, as ``dispatch.forcing`` arguments: the engine's
    choice (``chosen``, twice), each product path for every product (the layers per op) where it
    applies to all of them, and each one-call layer variant that applies (its products inside; the
    LM head by its own table)."""
    weights, layer = decode_weights(decoder), decoder.layers[0]
    sides = {"chosen": {}, "chosen_again": {}}
    for name in SINGLE:
        if name not in products.APPLIES or all(products.APPLIES[name](torch.empty(m, w.shape[1]), w) for w in weights):
            sides[name] = {"product": name, "layer": "unfused"}
    x = torch.empty(m, 1, layer.self_attn.q_proj.weight.shape[1])
    if isinstance(layer, FastDecoderLayer):
        sides.update({path: {"layer": path} for path in FUSED if fast_layers.applies(path, layer, x, cache_k)})
    return sides


def measure_steps(decoder, rows: list[int], repeats: int = 9) -> list[dict]:
    """Per row count: whole decode steps (m rows of one new token after ``CONTEXT`` cached ones: the
    layers, the LM head, the glue) under each of ``step_sides``: ``{side}_ms`` (best of ``repeats``),
    ``vs_chosen`` (the paired ratio of each single side to the chosen one), ``best_single``,
    ``chosen_vs_best``, ``same_path``. Where the tables pick the one-call layer, its products may lose
    to torch's while the whole step wins: this compares what a step costs."""
    cfg, out = decoder.config, []
    with torch.inference_mode():
        for m in rows:
            cache = KVCache.for_model(decoder, batch=m, max_len=CONTEXT + 1)
            cache.k.normal_(), cache.v.normal_()  # (what the keys hold does not change the time)
            token = torch.randint(cfg.vocab_size, (m, 1), generator=torch.Generator().manual_seed(m))

            def step(paths):
                def run():
                    cache.set_lengths(torch.full((m,), CONTEXT), span=CONTEXT)
                    with dispatch.forcing(paths):
                        decoder(token, cache=cache)
                return run
            times = rounds({name: step(paths) for name, paths in step_sides(decoder, m, cache.k).items()}, repeats)
            vs = {n: paired_ratio(ts, times["chosen"]) for n, ts in times.items()
                  if n not in ("chosen", "chosen_again")}
            single = min(vs, key=vs.get)
            out.append({"rows": m, **{f"{n}_ms": min(ts) * 1e3 for n, ts in times.items()}, "vs_chosen": vs,
                        "best_single": single, "chosen_vs_best": vs[single],
                        "same_path": paired_ratio(times["chosen_again"], times["chosen"])})
    return out


def steps_summary(result: list[dict]) -> str:
    same = sorted(r["same_path"] for r in result)
    worst = min(result, key=lambda r: r["chosen_vs_best"])
    return (f"whole steps: chosen vs best >= 1 at {sum(r['chosen_vs_best'] >= 1 for r in result)}/{len(result)} "
            f"row counts, >= 0.97 at {sum(r['chosen_vs_best'] >= 0.97 for r in result)}, worst "
            f"{worst['chosen_vs_best']:.2f} at {worst['rows']} rows ({worst['best_single']}); the chosen step "
            f"timed twice: {same[0]:.2f}-{same[-1]:.2f}")


def summary(result: list[dict]) -> str:
    """How the chosen paths compare with the best single path over ``measure``'s rows."""
    itself = [r for r in result if r["chosen_is"] == r["best_single"]]
    other = [r for r in result if r["chosen_is"] != r["best_single"]]
    same = sorted(r["same_path"] for r in result)
    line = (f"the chosen path is the best single path itself at {len(itself)}/{len(result)} row counts; "
            f"the same paths timed twice: {same[0]:.2f}-{same[-1]:.2f}")
    if other:
        worst = min(other, key=lambda r: r["chosen_vs_best"])
        line += (f"; elsewhere chosen vs best >= 1 at {sum(r['chosen_vs_best'] >= 1 for r in other)}/{len(other)}, "
                 f">= 0.97 at {sum(r['chosen_vs_best'] >= 0.97 for r in other)}, worst {worst['chosen_vs_best']:.2f} "
                 f"at {worst['rows']} rows")
    return line


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a[r] / b[r]: two sides timed in the same rounds, compared within each."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired timings need the same number of rounds (>= 1), got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


def _us(times: dict[int, dict[str, float]]) -> dict:
    return {m: {n: s * 1e6 for n, s in ts.items()} for m, ts in times.items()}


def _ranges(table: dispatch.Table) -> str:
    return ", ".join(f"{lo}-{hi} {name}" if hi > lo else f"{lo} {name}" for lo, hi, name in table.ranges) \
        + f", >{table.ranges[-1][1]} {table.by_rows[0]}"


def run(model_name: str = "smollm2", rows=tuple(range(1, 65)), threads: int = 2, repeats: int = 9,
        dtypes=("float32",), remeasure: bool = False, json_path: str | None = None, step_rows=STEP_ROWS) -> dict:
    torch.set_num_threads(threads)
    model = load_policy(MODELS.get(model_name, model_name))[0]
    if remeasure:
        dispatch.forget()
    report = {"model": model_name, "threads": threads, "repeats": repeats, "machine": dispatch.machine(),
              "tables": [], "rows": [], "steps": []}
    for dtype in dtypes:
        decoder = RolloutWeights(model, getattr(torch, dtype)).policy  # as the engine decodes: placed alike
        weights = decode_weights(decoder)
        tabs = tables(decoder, weights)
        print(f"bench gemv: {model_name}, {dtype} weights, {threads} threads, {report['machine']['cpu']}: "
              f"dispatch tables (rows -> path)")
        for t in tabs:
            busy = t["table"].busy and f" (timed while others used {t['table'].busy:.1f} cores: rerun when idle)"
            print(f"  {t['op']} {t['key']} (x{t['weights']}): {_ranges(t['table'])}{busy or ''}")
        result = measure(weights, list(rows), repeats, paths=lambda m: engine_paths(decoder, weights, m))
        mb = result[0]["bytes"] / 1e6
        print(f"{len(weights)} products, {mb:.0f} MB of {dtype} weights, best of {repeats}; ms for all; "
              f"chosen vs best = the lowest over single paths of the median over rounds of (its time / the "
              f"chosen path's in the same round); same path = that for the chosen paths timed again")
        columns = ["sum", *SINGLE, "chosen", "chosen_again"]
        print(format_table([[r["rows"], *(r[f"{c}_ms"] for c in columns), r["chosen_GBps"], r["best_single"],
                             r["chosen_vs_best"], r["same_path"]] for r in result],
                           ["rows", "sum (floor)", *SINGLE, "chosen", "again", "chosen GB/s", "best single",
                            "chosen vs best", "same path"]))
        print(summary(result) + "\n")
        if step_rows:
            steps = measure_steps(decoder, list(step_rows), repeats)
            print(f"whole decode steps ({CONTEXT} cached tokens a row), {dtype} weights, ms, best of {repeats}: the "
                  f"engine's choice against each path forced everywhere")
            columns = [*SINGLE, *FUSED, "chosen", "chosen_again"]
            print(format_table([[r["rows"], *(r.get(f"{c}_ms") for c in columns), r["best_single"], r["chosen_vs_best"],
                                 r["same_path"]] for r in steps],
                               ["rows", *SINGLE, *FUSED, "chosen", "again", "best single", "chosen vs best",
                                "same path"]))
            print(steps_summary(steps) + "\n")
            report["steps"] += [{"dtype": dtype, **r} for r in steps]
        report["tables"] += [{"dtype": dtype, "op": t["op"], "key": t["key"], "weights": t["weights"],
                              "ranges": t["table"].ranges, "times_us": _us(t["table"].times),
                              "busy_cores": t["table"].busy} for t in tabs]
        report["rows"] += [{"dtype": dtype, **r} for r in result]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return report
