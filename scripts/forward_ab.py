"""SmolLM2-135M decode forwards (into a KV cache of 120 tokens, tapping DSpark's layers) at the shapes a
plain step and a speculative verify have: batch 1 and 8, 1, 3 and 5 new tokens per row (γ = 0, 2, 4);
ms, min / 7th of 25 calls. Run it from two checkouts in turn to compare kernel builds on one machine
(docs/bench-spec.md, "Every row of a step in one pass over the weights (session 18)").

Usage: python scripts/forward_ab.py [fp32|bf16]
"""
import sys
from time import perf_counter

import torch

from codraft.models.kv_cache import KVCache
from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights

SHAPES = ((1, 1), (1, 3), (1, 5), (8, 1), (8, 3))  # (rows, new tokens per row)
TAPS = (1, 14, 15, 26)


def main(dtype: str = "bf16"):
    policy, _, _ = load_policy("smollm2-135m")
    policy.eval()
    model = RolloutWeights(policy, torch.bfloat16 if dtype == "bf16" else torch.float32).policy  # as the engine's
    out = []
    with torch.inference_mode():
        for b, t in SHAPES:
            cache = KVCache.for_model(model, b, 400)
            model(torch.randint(0, 49152, (b, 120)), cache=cache, logit_index=torch.full((b,), 119))
            lengths = cache.lengths.clone()
            ids = torch.randint(0, 49152, (b, t))
            ms = []
            for _ in range(25):
                cache.set_lengths(lengths, span=120)
                start = perf_counter()
                model(ids, cache=cache, taps=TAPS)
                ms.append((perf_counter() - start) * 1e3)
            ms.sort()
            out.append(f"B{b}xT{t} {ms[0]:.1f}/{ms[6]:.1f}")
    print(dtype, " ".join(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
