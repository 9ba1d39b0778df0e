"""Does a draft's state stay right (docs/real-preset.md, "Session 31")? Greedy equality with plain
decoding (the tests) cannot see a block draft whose state went stale; its acceptance can. The offline
DSpark draft on SmolLM2's bf16 rollout copy, T = 1, held-out prompts, batches of B:

1. after plain rounds (g = 0: the draft only commits the token): the acceptance per position of the
   drafted rounds when every round drafts 4, against patterns with plain rounds in between;
2. after rows finish and the caches compact: with every round drafting 4, the first position's
   acceptance by live rows and by tokens emitted so far (a misaligned state would accept near 0).

Usage: python scripts/plain_rounds_ab.py [BATCH] [PROMPTS]   (default 1 16; e.g. 16 48)
"""
import collections
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
real, real_count = eng_mod.Rollout.draft_length, eng_mod.Rollout._count
by_rows = collections.defaultdict(lambda: [0, 0])  # live rows -> [rows drafted, rows accepting >= 1]
by_emitted = collections.defaultdict(lambda: [0, 0])  # tokens emitted so far -> the same


def count(self, rows, g, accepted):
    if every_round:
        emitted = int(self.n_out[self.rows].float().mean())
        for table, key in ((by_rows, "1" if rows == 1 else "2-3" if rows <= 3 else "4-8" if rows <= 8 else "9+"),
                           (by_emitted, "<32" if emitted < 32 else "32-63" if emitted < 64 else ">=64")):
            table[key][0] += rows
            table[key][1] += accepted[0]
    return real_count(self, rows, g, accepted)


eng_mod.Rollout._count = count
for rep in range(2):
    for name, pat in patterns.items():
        counter, every_round = iter(range(10**9)), name == "always 4"
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
eng_mod.Rollout.draft_length, eng_mod.Rollout._count = real, real_count
for title, table in (("live rows", by_rows), ("tokens emitted", by_emitted)):
    print(f"P(accept >= 1 | drafted), every round 4, by {title}: " +
          ", ".join(f"{k} {a / n:.3f} ({n})" for k, (n, a) in sorted(table.items())))
