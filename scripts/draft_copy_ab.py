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

import torch

from codraft.bench import machine_info
from codraft.bench.spec import _prompts
from codraft.rollout import Engine

from rollout_ab import interleaved, smollm2_dspark  # (this folder)


def main(batch: int = 1, repeats: int = 2, gamma: int = 4) -> None:
    tok, weights, draft = smollm2_dspark(gamma)
    target = weights.policy
    shared = copy.copy(draft).bind_target(target.embed_tokens.weight, target.head_weight)  # fp32 draft weights
    sides = {"plain": Engine(target), "draft fp32": Engine(target, shared, gamma),
             "draft bf16 copy": Engine(target, weights.draft_for(draft), gamma)}
    prompts = _prompts(tok, 16)
    out = interleaved(sides, prompts, batch, repeats, tok.eos_id)
    cpu = machine_info(kernels=False)["processor"]
    print(f"batch {batch}, γ = {gamma}, {repeats} x {len(prompts)} prompts, T = 1; {cpu}, "
          f"{torch.get_num_threads()} threads")
    plain = out["plain"]["tokens"] / out["plain"]["seconds"]
    for name, s in out.items():
        rate = s["tokens"] / s["seconds"]
        r, tau = max(s["rounds"], 1), s["emitted_tokens"] / s["row_rounds"]
        print(f"  {name:16s} {rate:7.1f} tok/s  {rate / plain:.3f}x plain  τ {tau:.2f}"
              f"  draft {1e3 * s['draft_s'] / r:.2f} / verify {1e3 * s['verify_s'] / r:.2f} ms a round")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
