"""SmolLM2-135M decode steps with the GEMV kernel as tuned on this machine (``gemv.tuning``) and the
bf16 rollout copy in 2 MB pages (``hugepages``), against the kernel's earlier fixed behaviour (weight
rows always in pairs, prefetch into L2) and the copy in the allocator's 4 KB pages; same process,
interleaved (docs/bench-spec.md, "Huge pages and the kernel's tuning").

Usage: python scripts/tuning_ab.py [BATCH] [ROUNDS]   (about 1-2 minutes per batch on 2 CPU cores)
Prints ms per decode step (greedy, EOS off, 48 tokens, prefill excluded), min and median over the
rounds, and checks that every setting gives the same tokens.
"""
import sys

import torch

from codraft.bench.spec import CHAT_PROMPTS
from codraft.kernels import cbuild, gemv
from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.rollout.weights import RolloutWeights

N = 48
OLD = gemv.setting("L2", 1)


def small_pages(model):
    """``model`` with every matrix back in memory of its own (the allocator's pages)."""
    for p in model.parameters():
        if p.dim() >= 2:
            p.data = p.detach().clone()
    return model


def main(batch: int = 1, rounds: int = 4):
    policy, tok, _ = load_policy("smollm2-135m")
    policy.eval()
    if gemv.kernel() is None:
        sys.exit("the C kernels are off (CODRAFT_KERNELS=0) or could not be built")
    lib = cbuild.library()
    chosen = gemv.current(lib)
    prompts = [tok.prompt_ids(p) for p in CHAT_PROMPTS[:batch]]
    huge = RolloutWeights(policy, torch.bfloat16)
    models = {"fp32": policy, "bf16 4 KB pages": small_pages(RolloutWeights(policy, torch.bfloat16).policy),
              f"bf16 2 MB pages ({huge.huge_pages})": huge.policy}
    engines = {name: Engine(m) for name, m in models.items()}
    for engine in engines.values():
        engine.generate(prompts, 4, temperature=0.0, eos_id=[])  # dispatch tables, allocator
    ms, tokens = {}, {}
    try:
        for _ in range(rounds):
            for name, engine in engines.items():
                for tuned in (False, True):
                    gemv.apply(lib, chosen if tuned else dict.fromkeys(gemv.DTYPES, OLD))
                    out = engine.generate(prompts, N, temperature=0.0, eos_id=[])
                    s = engine.stats
                    ms.setdefault((name, tuned), []).append((s.verify_s + s.bookkeeping_s) / (N - 1) * 1e3)
                    tokens.setdefault(name[:4], set()).add(str([r.tokens for r in out]))
    finally:
        gemv.apply(lib, chosen)
    print(f"batch {batch}, {rounds} rounds, {torch.get_num_threads()} threads; tuned here: {chosen}")
    print("ms per decode step (min / median):")
    for name in engines:
        old, new = (sorted(ms[name, t]) for t in (False, True))
        print(f"  {name:24s} fixed {old[0]:6.2f} / {old[len(old) // 2]:6.2f}   tuned {new[0]:6.2f} / "
              f"{new[len(new) // 2]:6.2f}   {old[0] / new[0]:.2f}x")
    best = {name: min(ms[name, True]) for name in engines}
    (_, f32), (_, small), (_, big) = best.items()
    print(f"  bf16 2 MB vs 4 KB pages (tuned): {small / big:.2f}x; "
          f"bf16 (2 MB, tuned) vs fp32 (tuned): {f32 / big:.2f}x")
    print(f"  same tokens in every setting: {all(len(t) == 1 for t in tokens.values())}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
