"""Does a draft stay as good after plain rounds (g = 0: the draft only commits the token)? The offline
DSpark draft on SmolLM2's bf16 rollout copy, T = 1, held-out prompts: the acceptance per position of
the drafted rounds when every round drafts 4, against patterns with plain rounds in between
(docs/real-preset.md, "Session 31"). Greedy equality with plain decoding (the tests) cannot see a draft
whose state went stale; this can.

Usage: python scripts/plain_rounds_ab.py [BATCH] [PROMPTS]   (default 1 16)
"""
import sys

import torch

from codraft.bench.spec import _prompts
from codraft.policy import load_policy
from codraft.rollout import engine as eng_mod
from codraft.rollout.engine import Engine
from codraft.rollout.weights import RolloutWeights
from codraft.train.offline_draft import draft_for_command

B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
N = int(sys.argv[2]) if len(sys.argv) > 2 else 16
policy, tok, folder = load_policy("smollm2-135m")
policy.eval()
w = RolloutWeights(policy, torch.bfloat16)
draft = w.draft_for(draft_for_command("dspark", policy, tok, folder, gamma=4, init="offline"))
engine = Engine(w.policy, draft, gamma=4)
prompts = _prompts(tok, N)
patterns = {"always 4": lambda i: 4, "0,4 alternating": lambda i: 4 * (i % 2), "0,0,0,4": lambda i: 4 * (i % 4 == 3)}
real = eng_mod.Rollout.draft_length
for rep in range(2):
    for name, pat in patterns.items():
        counter = iter(range(10**9))
        eng_mod.Rollout.draft_length = lambda self, rows: pat(next(counter))
        drafted = [0] * 4
        accepted = [0] * 4
        for i in range(0, N, B):
            engine.generate(prompts[i:i + B], 128, temperature=1.0, eos_id=tok.eos_id, seed=100 * rep + i)
            st = engine.stats
            for k in range(4):
                drafted[k] += st.drafted_per_position[k]
                accepted[k] += st.accepted_per_position[k]
        rates = [a / d if d else float("nan") for a, d in zip(accepted, drafted)]
        print(f"rep {rep} {name:16s} drafted {drafted[0]:5d}  P(accept >= k | drafted) " +
              " ".join(f"{r:.3f}" for r in rates), flush=True)
eng_mod.Rollout.draft_length = real
