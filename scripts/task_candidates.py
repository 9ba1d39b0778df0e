"""Score SmolLM2-135M-Instruct on candidate chain_sum settings (docs/real-preset.md).

Usage: python scripts/task_candidates.py [N_PROMPTS]   (about 5 minutes on 2 CPU cores)
"""
import json
import sys
import time

from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.tasks import make_task

CANDIDATES = [("2-3 terms, 1 digit", dict(max_terms=3, max_digits=1)),
              ("3 terms, 1 digit", dict(min_terms=3, max_terms=3, max_digits=1)),
              ("2 terms, 1-2 digits", dict()),
              ("2-3 terms, 1-2 digits", dict(max_terms=3)),
              ("2 terms, 2 digits", dict(min_digits=2))]


def main(n: int = 48):
    policy, tok, _ = load_policy("smollm2-135m")
    engine = Engine(policy)
    for name, knobs in CANDIDATES:
        task = make_task("chain_sum", **knobs)
        problems = task.sample("val", n, seed=0)
        prompts = [tok.prompt_ids(p.prompt) for p in problems]
        for temperature in (0.0, 1.0):
            t0 = time.time()
            out = engine.generate(prompts, 256, temperature=temperature, seed=1, eos_id=tok.eos_id)
            score = sum(task.reward(p, tok.decode(o.tokens)) for p, o in zip(problems, out)) / n
            lens = [len(o.tokens) for o in out]
            print(json.dumps({"task": f"chain_sum {name}", "temperature": temperature, "prompts": n, "score": score,
                              "mean_tokens": sum(lens) / n, "max_tokens": max(lens),
                              "truncated": sum(o.finish_reason == "length" for o in out),
                              "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
