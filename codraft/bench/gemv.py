"""`codraft bench gemv`: how fast a model's weights stream through few-row products.

For each row count, the same run times, interleaved, every 2-D weight a decode step multiplies
(all layers' projections and the LM head, in order): a ``sum`` over each weight (what reading
it costs, the floor), torch's products (``torch_product``: what ``codraft.kernels.products.linear`` runs
without the kernel) and the C kernel (``codraft.kernels.gemv``). Figures are GB/s of weights read (best of
``repeats``).
"""
from __future__ import annotations

import json
from time import perf_counter

import torch

from codraft.bench import format_table
from codraft.bench.spec import MODELS
from codraft.kernels import gemv
from codraft.kernels.products import torch_product
from codraft.policy import load_policy


def decode_weights(model) -> list[torch.Tensor]:
    """The weights one decode step multiplies, in forward order (a tied LM head once, last)."""
    ws = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        ws += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
               m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    return [w.detach() for w in ws] + [model.head_weight.detach()]


def measure(weights: list[torch.Tensor], rows: list[int], repeats: int = 5) -> list[dict]:
    if gemv.kernel() is None:
        raise RuntimeError("the GEMV kernel is not available (no C compiler, or CODRAFT_KERNELS=0)")
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    sides = {"sum": lambda x, w: w.sum(), "torch": torch_product, "kernel": gemv.gemv}
    out = []
    with torch.inference_mode():
        for m in rows:
            xs = {i: torch.randn(m, i) for i in {w.shape[1] for w in weights}}
            best = dict.fromkeys(sides, float("inf"))
            for _ in range(repeats + 1):  # the first round warms up
                for name, fn in sides.items():
                    t = perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    best[name] = min(best[name], perf_counter() - t)
            out.append({"rows": m, "bytes": nbytes, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
                        **{f"{k}_GBps": nbytes / v / 1e9 for k, v in best.items()}})
    return out


def run(model_name: str = "smollm2", rows=(1, 2, 4, 8, 16, 32), threads: int = 2, repeats: int = 5,
        json_path: str | None = None) -> list[dict]:
    torch.set_num_threads(threads)
    model = load_policy(MODELS.get(model_name, model_name))[0]
    weights = decode_weights(model)
    result = measure(weights, list(rows), repeats)
    mb = result[0]["bytes"] / 1e6
    print(f"bench gemv: {model_name}, {len(weights)} weights, {mb:.0f} MB fp32, {threads} threads, "
          f"best of {repeats}; GB/s of weights read")
    print(format_table([[r["rows"], r["sum_GBps"], r["torch_GBps"], r["kernel_GBps"], r["torch_ms"], r["kernel_ms"],
                         r["torch_ms"] / r["kernel_ms"]] for r in result],
                       ["rows", "sum", "torch", "kernel", "torch ms", "kernel ms", "kernel speedup"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model_name, "threads": threads, "repeats": repeats, "rows": result}, f, indent=2)
        print(f"wrote {json_path}")
    return result
