"""The offline DSpark draft of SmolLM2 with its rollout copy narrowed to bf16 (``Draft.rollout_narrowed``,
what the engine runs) against the same draft sharing its fp32 weights, and plain decoding, all on the
bf16 rollout copy of the target, in one process, interleaved (docs/real-preset.md, session 27).

Rollouts as the benchmark samples them: T = 1, EOS on, 16 held-out prompts per repetition, B at a time,
the same seeds on every side. Prints tokens/s against plain, τ, and the draft's and the verify's ms a
round. The offline draft is trained first if it is not cached (minutes).

Usage: python scripts/draft_copy_ab.py [BATCH] [REPEATS] [GAMMA]   (default 1 2 4; ~4 minutes at batch 1)
"""
import copy
import sys
from collections import defaultdict
from time import perf_counter

import torch

from codraft.bench import machine_info
from codraft.bench.spec import _prompts
from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.rollout.weights import RolloutWeights
from codraft.train.offline_draft import draft_for_command


def main(batch: int = 1, repeats: int = 2, gamma: int = 4) -> None:
    policy, tok, folder = load_policy("smollm2-135m")
    policy.eval()
    draft = draft_for_command("dspark", policy, tok, folder, gamma=gamma, init="offline")
    weights = RolloutWeights(policy, torch.bfloat16)
    target = weights.policy
    shared = copy.copy(draft).bind_target(target.embed_tokens.weight, target.head_weight)  # fp32 draft weights
    sides = {"plain": Engine(target), "draft fp32": Engine(target, shared, gamma),
             "draft bf16 copy": Engine(target, weights.draft_for(draft), gamma)}
    prompts = _prompts(tok, 16)
    for e in sides.values():  # warm-up: dispatch tables, allocator
        e.generate(prompts[:batch], 16, temperature=1.0, eos_id=[tok.eos_id], seed=0)
    seconds, tokens, stats = defaultdict(float), defaultdict(int), defaultdict(lambda: defaultdict(float))
    for rep in range(repeats):
        for i in range(0, len(prompts), batch):
            for name, e in sides.items():
                t = perf_counter()
                out = e.generate(prompts[i:i + batch], 128, temperature=1.0, eos_id=[tok.eos_id],
                                 seed=1 + i + len(prompts) * rep)
                seconds[name] += perf_counter() - t
                tokens[name] += sum(len(o.tokens) for o in out)
                for k in ("rounds", "row_rounds", "emitted_tokens", "draft_s", "verify_s"):
                    stats[name][k] += getattr(e.stats, k)
    cpu = machine_info(kernels=False)["processor"]
    print(f"batch {batch}, γ = {gamma}, {repeats} x {len(prompts)} prompts, T = 1; {cpu}, "
          f"{torch.get_num_threads()} threads")
    plain = tokens["plain"] / seconds["plain"]
    for name in sides:
        s, rate = stats[name], tokens[name] / seconds[name]
        r, tau = max(s["rounds"], 1), s["emitted_tokens"] / s["row_rounds"]
        print(f"  {name:16s} {rate:7.1f} tok/s  {rate / plain:.3f}x plain  τ {tau:.2f}"
              f"  draft {1e3 * s['draft_s'] / r:.2f} / verify {1e3 * s['verify_s'] / r:.2f} ms a round")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
