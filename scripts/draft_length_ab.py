"""Same-process A/B of two draft-length cost models (docs/real-preset.md, session 28): SmolLM2's bf16
rollout copy with its offline DSpark draft, plain decoding and ``gamma="auto"`` under each model, every
call of B held-out prompts run by each side in turn, T = 1 (as rollouts sample) or 0. A model is a
calibration file (``{"rows", "target_s", "draft_s"}``, as ``$CODRAFT_CACHE/calibration/`` holds them), or
``new`` for this checkout's own calibration of the pair (``load_or_calibrate``).

The two auto sides sample different completions once their g's differ (the same seeds draw other
tokens), so a ratio over few prompts mixes the model with the samples' lengths: use 64 prompts or more,
and several offsets.

Usage: python scripts/draft_length_ab.py MODEL_A MODEL_B [--batch 8] [--prompts 64] [--offset 0]
       [--repeats 2] [--temperature 1.0]
"""
import argparse
import json
from pathlib import Path

import torch

from codraft.bench.spec import _prompts
from codraft.rollout import CostModel, Engine, load_or_calibrate

from rollout_ab import interleaved, smollm2_dspark  # (this folder)


def read_model(path: str) -> CostModel:
    d = json.loads(Path(path).read_text())
    return CostModel(tuple(d["rows"]), tuple(map(tuple, d["target_s"])), tuple(map(tuple, d["draft_s"])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs=2, help="calibration files, or new")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--offset", type=int, default=0, help="skip this many held-out prompts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args()
    torch.set_num_threads(2)
    tok, weights, draft = smollm2_dspark()
    target, draft = weights.policy, weights.draft_for(draft)
    sides = {"plain": Engine(target)}
    for i, m in enumerate(a.models):
        cost = load_or_calibrate(target, draft, draft.default_gamma, a.batch) if m == "new" else read_model(m)
        sides[f"auto {'AB'[i]}"] = Engine(target, draft, "auto", cost_model=cost)
    prompts = _prompts(tok, a.prompts + a.offset)[a.offset:]
    out = interleaved(sides, prompts, a.batch, a.repeats, tok.eos_id, a.temperature)
    plain = out["plain"]["tokens"] / out["plain"]["seconds"]
    for k, s in out.items():
        rate = s["tokens"] / s["seconds"]
        print(f"T={a.temperature} batch {a.batch}, {len(prompts)} prompts x {a.repeats}: {k}: {s['tokens']} tokens, "
              f"{rate:.1f} tok/s, {rate / plain:.3f}x plain, rounds by g {s['gamma_chosen'] or '-'}")


if __name__ == "__main__":
    main()
