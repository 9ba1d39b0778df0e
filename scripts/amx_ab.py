"""bf16 products and SmolLM2's decoder stack on AMX tiles vs the vector kernel, same process,
interleaved (docs/bench-spec.md, "bf16 products on AMX tiles"). Needs a CPU with AMX.

Usage: python scripts/amx_ab.py [ROWS] [ROUNDS]   (ROWS a comma list, default 8,16,24,40,64; ~1 minute)
Prints µs per product for SmolLM2's largest shapes (each call on the next of copies of the weight,
so it streams from memory), then ms per forward of the 30-layer stack in one C call at batch 8.
Each pair is checked to agree (the same product up to fp32 summation order).
"""
import sys
from time import perf_counter

import torch

from codraft.kernels import amx, decode_ops, dispatch, gemv
from codraft.models.kv_cache import KVCache
from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights


def _best(calls: dict, rounds: int) -> dict:
    """{name: best seconds} over rounds, the order of the calls alternating each round."""
    best = dict.fromkeys(calls, float("inf"))
    for r in range(rounds):
        for name in (list(calls) if r % 2 else list(calls)[::-1]):
            t = perf_counter()
            calls[name]()
            best[name] = min(best[name], perf_counter() - t)
    return best


def products(rows: list[int], rounds: int):
    print("µs per product, bf16 weights from memory (vector kernel -> AMX):")
    for shape in ((1536, 576), (576, 1536), (49152, 576)):
        w = torch.randn(*shape).bfloat16()
        ws = w.expand(dispatch.copies(w.numel() * 2), *shape).contiguous()
        line = []
        for m in rows:
            x = torch.randn(m, shape[1])
            torch.testing.assert_close(amx.gemm(x, ws[0]), gemv.gemv(x, ws[0]), rtol=1e-4, atol=1e-3)

            def over_copies(fn):
                return lambda: [fn(x, wi) for wi in ws]
            t = _best({"kernel": over_copies(gemv.gemv), "amx": over_copies(amx.gemm)}, rounds)
            line.append(f"{m} rows {t['kernel'] / len(ws) * 1e6:.0f} -> {t['amx'] / len(ws) * 1e6:.0f}")
        print(f"  {shape[0]}x{shape[1]}: " + ", ".join(line))


def stack(rows: list[int], rounds: int):
    policy = load_policy("smollm2-135m")[0].eval()
    model = RolloutWeights(policy, torch.bfloat16).policy
    layers = list(model.layers)
    print("ms per forward of SmolLM2's 30 bf16 layers in one C call, batch 8 (vector kernel -> AMX):")
    line = []
    for m in rows:
        b, t = 8, max(1, m // 8)
        cache = KVCache.for_model(model, b, 256)
        x = torch.randn(b, t, policy.config.hidden_size)
        with torch.inference_mode():
            ctx = model.layer_inputs(b, t, "cpu", cache=cache)

            def run(on_amx):
                def call():
                    cache.set_lengths(torch.full((b,), 100), span=100)
                    return decode_ops.decoder_stack(model, 0, layers, x, ctx.cos, ctx.sin, cache, amx=on_amx)[0]
                return call
            on_tiles, on_vectors = run(True)(), run(False)()  # 30 layers of fp32 sums in another order:
            assert (on_tiles - on_vectors).norm() <= 1e-4 * on_vectors.norm(), "AMX and vector stacks disagree"
            best = _best({"kernel": run(False), "amx": run(True)}, rounds)
        line.append(f"{b * t} rows {best['kernel'] * 1e3:.1f} -> {best['amx'] * 1e3:.1f}")
    print("  " + ", ".join(line))


def main(rows: str = "8,16,24,40,64", rounds: int = 7):
    if not amx.ready():
        sys.exit("this CPU has no AMX (or Linux did not grant the tile state): nothing to compare")
    torch.set_num_threads(2)
    print(f"{dispatch.machine()['cpu']}, {torch.get_num_threads()} threads")
    counts = [int(r) for r in rows.split(",")]
    products(counts, rounds)
    stack(counts, rounds)


if __name__ == "__main__":
    main(*(int(a) if i else a for i, a in enumerate(sys.argv[1:])))
