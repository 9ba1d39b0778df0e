"""What the rollout A/B scripts share (draft_copy_ab.py, draft_length_ab.py, draft_length_error.py):
SmolLM2 with its bf16 rollout copy and offline DSpark draft, and rollouts of held-out prompts run by
several engines in turn. Imported by those scripts (``python scripts/<name>.py`` puts this folder on
the path); it runs nothing itself.
"""
from time import perf_counter

import torch

from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights
from codraft.train.offline_draft import draft_for_command

STATS = ("rounds", "row_rounds", "emitted_tokens", "draft_s", "verify_s")


def smollm2_dspark(gamma: int = 4):
    """(tokenizer, the bf16 rollout weights, the offline DSpark draft in fp32) of SmolLM2; the draft is
    trained first if it is not cached (minutes). ``weights.policy`` is the target the engines decode
    with, ``weights.draft_for(draft)`` the draft's rollout copy."""
    policy, tok, folder = load_policy("smollm2-135m")
    policy.eval()
    draft = draft_for_command("dspark", policy, tok, folder, gamma=gamma, init="offline")
    return tok, RolloutWeights(policy, torch.bfloat16), draft


def interleaved(sides: dict, prompts: list, batch: int, repeats: int, eos: int, temperature: float = 1.0):
    """Rollouts of ``prompts``, ``batch`` at a time, each call by every engine of ``sides`` in turn with the
    same seed, after a short warm-up call each (dispatch tables, allocator): per side, the wall seconds,
    the tokens emitted, the sums of the stats' ``STATS`` and ``gamma_chosen`` (None without a draft)."""
    for e in sides.values():
        e.generate(prompts[:batch], 16, temperature=1.0, eos_id=[eos], seed=0)
    out = {name: {"seconds": 0.0, "tokens": 0, "gamma_chosen": None, **dict.fromkeys(STATS, 0.0)} for name in sides}
    for rep in range(repeats):
        for i in range(0, len(prompts), batch):
            for name, e in sides.items():
                t = perf_counter()
                res = e.generate(prompts[i:i + batch], 128, temperature=temperature, eos_id=[eos],
                                 seed=1 + i + len(prompts) * rep)
                o = out[name]
                o["seconds"] += perf_counter() - t
                o["tokens"] += sum(len(r.tokens) for r in res)
                for k in STATS:
                    o[k] += getattr(e.stats, k)
                g, seen = e.stats.gamma_chosen, o["gamma_chosen"]
                if g:
                    o["gamma_chosen"] = g if seen is None else [x + y for x, y in zip(seen, g)]
    return out
