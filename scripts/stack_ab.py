"""SmolLM2-135M decode with the decoder stack in one C call vs one C call per layer, same process,
interleaved, fp32 and the bf16 rollout copy (docs/bench-spec.md, "The whole stack in one call").

Usage: python scripts/stack_ab.py [BATCH] [ROUNDS]   (about 1 minute per batch on 2 CPU cores)
Prints ms per decode step (greedy, EOS off, 48 tokens, prefill excluded: the engine's verify and
bookkeeping time), min and median over the rounds, and checks that both paths give the same tokens.
"""
import sys

import torch

from codraft.bench.spec import CHAT_PROMPTS
from codraft.kernels import decode_ops
from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.rollout.weights import RolloutWeights

N = 48


def main(batch: int = 1, rounds: int = 4):
    policy, tok, _ = load_policy("smollm2-135m")
    policy.eval()
    prompts = [tok.prompt_ids(p) for p in CHAT_PROMPTS[:batch]]
    stack = decode_ops.decoder_stack
    engines = {dt: Engine(RolloutWeights(policy, getattr(torch, dt)).policy) for dt in ("float32", "bfloat16")}
    for engine in engines.values():
        engine.generate(prompts, 4, temperature=0.0, eos_id=[])  # dispatch tables, allocator
    ms, tokens = {}, {}
    for _ in range(rounds):
        for dt, engine in engines.items():
            for one_call in (False, True):
                decode_ops.decoder_stack = stack if one_call else (lambda *a, **k: None)  # None: layer by layer
                out = engine.generate(prompts, N, temperature=0.0, eos_id=[])
                s = engine.stats
                ms.setdefault((dt, one_call), []).append((s.verify_s + s.bookkeeping_s) / (N - 1) * 1e3)
                tokens.setdefault((dt, one_call), [r.tokens for r in out])
    decode_ops.decoder_stack = stack
    print(f"batch {batch}, {rounds} rounds, {torch.get_num_threads()} threads: ms per decode step (min / median)")
    for dt in engines:
        per_layer, one = (sorted(ms[dt, k]) for k in (False, True))
        print(f"  {dt:9s} call per layer {per_layer[0]:6.2f} / {per_layer[len(per_layer) // 2]:6.2f}"
              f"   whole stack {one[0]:6.2f} / {one[len(one) // 2]:6.2f}   speedup {per_layer[0] / one[0]:.2f}x"
              f"   same tokens: {tokens[dt, False] == tokens[dt, True]}")
    f32, b16 = (sorted(ms[dt, True])[0] for dt in engines)
    print(f"  whole stack, bf16 vs fp32: {f32 / b16:.2f}x")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
