"""The decode step's C parts, timed on this machine (docs/bench-spec.md, session 15):

* the GEMV kernel's tuning: every bf16 product of SmolLM2 in model order (what a decode step
  streams), ms per pass at 1-4 rows, with each prefetch mode (L1, L2, none) and the weight rows
  one or two at a time, interleaved;
* the attention of 30 layers (9 heads, 3 KV heads of 64) through ``cache_attention``, ms, at batch
  1 and 8, 1 and 3 new tokens per row, over 120 and 300 cached keys.

Usage: python scripts/decode_ab.py [ROUNDS]   (default 5; ~1 minute)
"""
import sys
from time import perf_counter

import torch

from codraft.kernels import cbuild, decode_ops, gemv
from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights


def tuning(rounds: int) -> None:
    weights = RolloutWeights(load_policy("smollm2-135m")[0], torch.bfloat16)
    model = weights.policy
    ws = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n] + [model.head_weight]
    if gemv.kernel() is None:  # also times and sets this machine's tuning on first use
        sys.exit("the C kernels are off (CODRAFT_KERNELS=0) or could not be built")
    lib = cbuild.library()
    chosen = gemv.current(lib)
    mine = chosen["bfloat16"]
    settings = [(mode, pairs) for mode in gemv.PREFETCH_MODES for pairs in (False, True)]
    best = {}
    try:
        for _ in range(rounds):
            for mode, pairs in settings:
                gemv.apply(lib, {"bfloat16": gemv.setting(mode, 1 if pairs else gemv.NEVER)})
                for rows in (1, 2, 3, 4):
                    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in ws}
                    t = perf_counter()
                    for w in ws:
                        gemv.gemv(xs[w.shape[1]], w)
                    key = (mode, pairs, rows)
                    best[key] = min(best.get(key, 1e9), perf_counter() - t)
    finally:
        gemv.apply(lib, chosen)
    print(f"SmolLM2 bf16 products (the rollout copy, huge pages: {weights.huge_pages}), ms per pass; this machine "
          f"chose {mine}:")
    for rows in (1, 2, 3, 4):
        print(f"  {rows} rows: " + "  ".join(f"{m}/{'pairs' if p else 'one'} {best[m, p, rows] * 1e3:6.2f}"
                                          for m, p in settings))


def attention(rounds: int) -> None:
    h, hkv, d, cache_len = 9, 3, 64, 400
    print("attention, 30 layers, ms:")
    for keys in (120, 300):
        for b, t in ((1, 1), (1, 3), (8, 1), (8, 3)):
            q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, hkv, d), torch.randn(b, t, hkv, d)
            cos, sin = torch.ones(b, 1, t, d), torch.zeros(b, 1, t, d)
            caches = [(torch.randn(b, hkv, cache_len, d), torch.randn(b, hkv, cache_len, d)) for _ in range(30)]
            lengths = torch.full((b,), keys)
            best = 1e9
            for _ in range(rounds + 1):
                start = perf_counter()
                for kc, vc in caches:
                    decode_ops.cache_attention(q, k, v, cos, sin, kc, vc, lengths)
                best = min(best, perf_counter() - start)
            print(f"  {keys} keys, batch {b} x {t} tokens: {best * 1e3:6.2f}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    tuning(n)
    attention(n)
