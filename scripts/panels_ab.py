"""SmolLM2-135M decode steps from the bf16 rollout copy with the decoder stack's products on the
weights as they are ("fused") vs packed in panels ("fused-panels"), same process, interleaved
(docs/bench-spec.md, "Weights packed in panels"; only bf16 copies, which nothing trains, are packed).

Usage: python scripts/panels_ab.py [BATCH] [ROUNDS]
Prints ms per decode step (greedy, EOS off, 48 tokens, prefill excluded), min and median over the
rounds, the path the measured layer table picks at that row count, and whether both give the same tokens.
"""
import sys

import torch

from codraft.bench.spec import CHAT_PROMPTS
from codraft.kernels import fast_layers
from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.rollout.weights import RolloutWeights

N = 48
PATHS = ("fused", "fused-panels")


def main(batch: int = 1, rounds: int = 4):
    policy, tok, _ = load_policy("smollm2-135m")
    policy.eval()
    prompts = [tok.prompt_ids(p) for p in (CHAT_PROMPTS * batch)[:batch]]
    engine = Engine(RolloutWeights(policy, torch.bfloat16).policy)
    engine.generate(prompts, 4, temperature=0.0, eos_id=[])  # dispatch tables, packed copies, allocator
    measured = fast_layers.layer_path
    ms, tokens = {}, {}
    try:
        for _ in range(rounds):
            for path in PATHS:
                fast_layers.layer_path = lambda layer, x, p=path: p
                out = engine.generate(prompts, N, temperature=0.0, eos_id=[])
                s = engine.stats
                ms.setdefault(path, []).append((s.verify_s + s.bookkeeping_s) / (N - 1) * 1e3)
                tokens.setdefault(path, [r.tokens for r in out])
    finally:
        fast_layers.layer_path = measured
    chosen = measured(engine.model.layers[0], torch.empty(batch, 1, policy.config.hidden_size))
    print(f"bf16, batch {batch}, {rounds} rounds, {torch.get_num_threads()} threads; the table picks {chosen}")
    for path, v in ms.items():
        v = sorted(v)
        print(f"  {path:13s} ms per decode step: min {v[0]:.1f}, median {v[len(v) // 2]:.1f}")
    print("  same tokens:", tokens[PATHS[0]] == tokens[PATHS[1]])


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
