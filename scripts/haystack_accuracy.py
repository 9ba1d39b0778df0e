"""Greedy held-out accuracy of the tiny-sft policy on `arith_haystack` by context length (docs/long-context.md).

Usage: python scripts/haystack_accuracy.py [N_PROBLEMS] [CONTEXT_CHARS ...] [--layout end|both]
(defaults: 32 problems; 0 1024 4096; layout end). One JSON line per context length.
"""
import json
import sys
import time

import torch

from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.tasks import make_task


def main(argv):
    layout = "end"
    if "--layout" in argv:
        i = argv.index("--layout")
        layout = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    n = int(argv[0]) if argv else 32
    lengths = [int(a) for a in argv[1:]] or [0, 1024, 4096]
    policy, tok, _ = load_policy("tiny-sft")
    policy.eval()
    for c in lengths:
        task = make_task("arith_haystack", context_chars=c, layout=layout)
        problems = task.sample("val", n, seed=0)
        prompts = [tok.prompt_ids(p.prompt) for p in problems]
        engine = Engine(policy, max_len=max(map(len, prompts)) + 64)  # the tiny config says 512 positions
        chunk = 8 if c >= 2048 else 32  # the prefill's cache mask is (rows, T, T)
        t0 = time.time()
        rewards, texts = [], []
        with torch.inference_mode():
            for i in range(0, n, chunk):
                out = engine.generate(prompts[i:i + chunk], 64, temperature=0.0, eos_id=tok.eos_id)
                for p, o in zip(problems[i:i + chunk], out):
                    texts.append(tok.decode(o.tokens))
                    rewards.append(task.reward(p, texts[-1]))
        print(json.dumps({"context_chars": c, "layout": layout, "problems": n, "accuracy": sum(rewards) / n,
                          "prompt_chars": len(problems[0].prompt), "seconds": round(time.time() - t0, 1),
                          "examples": [(p.meta["question"], t) for p, t in zip(problems[:3], texts[:3])]}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
