"""Where a batch-1 DSpark round's draft time goes: SmolLM2's bf16 rollout copy, the offline DSpark
draft, γ = 4, T = 1 on held-out prompts; each part of ``propose`` and ``commit`` wrapped in a timer
(docs/real-preset.md, "Session 31").

Usage: python scripts/draft_round_parts.py [PROMPTS]   (default 12; the offline draft is trained on
first use)
"""
import collections
import sys
import time

import torch

from codraft.bench.spec import _prompts
from codraft.policy import load_policy
from codraft.rollout.engine import Engine
from codraft.rollout.weights import RolloutWeights
from codraft.train.offline_draft import draft_for_command

n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
torch.manual_seed(0)
policy, tok, folder = load_policy("smollm2-135m")
policy.eval()
weights = RolloutWeights(policy, torch.bfloat16)
draft = weights.draft_for(draft_for_command("dspark", policy, tok, folder, gamma=4, init="offline"))
spent, calls = collections.defaultdict(float), collections.Counter()


def timed(name):
    real = getattr(draft, name)

    def run(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        spent[name] += time.perf_counter() - t
        calls[name] += 1
        return out
    setattr(draft, name, run)


for part in ("propose", "commit", "decode_hidden", "logits", "fused_markov", "full_probs", "to_target",
             "markov_input"):
    timed(part)
engine = Engine(weights.policy, draft, gamma=4)
prompts = _prompts(tok, n)
engine.generate(prompts[:1], 16, temperature=1.0, eos_id=tok.eos_id, seed=0)  # warm-up
spent.clear(), calls.clear()
rounds = tokens = 0
verify = draft_s = 0.0
for i, p in enumerate(prompts):
    out = engine.generate([p], 128, temperature=1.0, eos_id=tok.eos_id, seed=i)
    tokens, rounds = tokens + len(out[0].tokens), rounds + engine.stats.rounds
    verify, draft_s = verify + engine.stats.verify_s, draft_s + engine.stats.draft_s
print(f"{n} prompts, {tokens} tokens in {rounds} rounds (tau {tokens / rounds:.2f}); per round: verify "
      f"{1e3 * verify / rounds:.2f} ms, draft {1e3 * draft_s / rounds:.2f} ms")
for name in spent:
    print(f"  {name}: {1e3 * spent[name] / calls[name]:.2f} ms a call ({calls[name]} calls)")
