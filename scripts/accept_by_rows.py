"""Acceptance of the first drafted token by live row count and by tokens emitted so far: the offline DSpark
draft on SmolLM2's bf16 rollout copy, fixed γ = 4, T = 1, batches of B held-out prompts (rows finish and
the caches compact). A draft state misaligned after compaction would show as acceptance near 0 at few
rows (docs/real-preset.md, "Session 31").

Usage: python scripts/accept_by_rows.py B N   (e.g. 16 48)
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

B, N = int(sys.argv[1]), int(sys.argv[2])
policy, tok, folder = load_policy("smollm2-135m")
policy.eval()
w = RolloutWeights(policy, torch.bfloat16)
draft = w.draft_for(draft_for_command("dspark", policy, tok, folder, gamma=4, init="offline"))
engine = Engine(w.policy, draft, gamma=4)
prompts = _prompts(tok, N)
seen = collections.defaultdict(lambda: [0, 0])  # bucket -> [rows drafted, rows accepting >= 1]
pos = collections.defaultdict(lambda: [0, 0])  # emitted-so-far bucket -> same
real = eng_mod.Rollout._count


def count(self, rows, g, accepted):
    if g:
        bucket = "1" if rows == 1 else "2-3" if rows <= 3 else "4-8" if rows <= 8 else "9-16"
        seen[bucket][0] += rows; seen[bucket][1] += accepted[0]
        n = int(self.n_out[self.rows].float().mean())
        pb = "<32" if n < 32 else "32-64" if n < 64 else ">=64"
        pos[pb][0] += rows; pos[pb][1] += accepted[0]
    return real(self, rows, g, accepted)


eng_mod.Rollout._count = count
for i in range(0, N, B):
    engine.generate(prompts[i:i + B], 128, temperature=1.0, eos_id=tok.eos_id, seed=i)
print("by live rows:", {k: (v[0], round(v[1] / v[0], 3)) for k, v in sorted(seen.items())})
print("by tokens emitted:", {k: (v[0], round(v[1] / v[0], 3)) for k, v in sorted(pos.items())})
