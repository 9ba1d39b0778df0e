"""The decode step's C parts, timed on this machine (docs/bench-spec.md, session 15):

* the GEMV kernel's prefetch hint: every bf16 product of SmolLM2 in model order (what a decode step
  streams), ms per pass at 1-4 rows, with the weights prefetched into L1 and into L2, interleaved;
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


def prefetch(rounds: int) -> None:
    model = RolloutWeights(load_policy("smollm2-135m")[0], torch.bfloat16).policy
    ws = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n] + [model.head_weight]
    if gemv.kernel() is None:  # also times and sets this machine's hint on first use
        sys.exit("the C kernels are off (CODRAFT_KERNELS=0) or could not be built")
    lib = cbuild.library()
    chosen = lib.get_prefetch_l2()
    best = {}
    try:
        for _ in range(rounds):
            for l2 in (0, 1):
                lib.set_prefetch_l2(l2)
                for rows in (1, 2, 3, 4):
                    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in ws}
                    t = perf_counter()
                    for w in ws:
                        gemv.gemv(xs[w.shape[1]], w)
                    key = (l2, rows)
                    best[key] = min(best.get(key, 1e9), perf_counter() - t)
    finally:
        lib.set_prefetch_l2(chosen)
    print(f"SmolLM2 bf16 products, ms per pass (this machine chose {'L2' if chosen else 'L1'}):")
    for rows in (1, 2, 3, 4):
        print(f"  {rows} rows: L1 {best[0, rows] * 1e3:6.2f}  L2 {best[1, rows] * 1e3:6.2f}")


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
    prefetch(n)
    attention(n)
