"""What bf16 products (``codraft.models.bf16``) save training on this machine (docs/real-preset.md,
sessions 29-30), same process, sides interleaved with the order alternating:

1. offline steps: a DSpark and a DFlash step on SmolLM2's cached features (the recipe's batch: packing,
   teacher, the loss's forward and backward), fp32 against bf16 products, 4 fresh batches a round after
   2 rounds of warm-up;
2. the GRPO step's train part: ``cotrain_loss`` and its backward on one real rollout batch of the
   real preset (2 prompts × 8, up to 128 tokens, T = 1), the policy in fp32 and in bf16 products
   (grpo.precision), with no draft and with the preset's offline DSpark draft (16 blocks a sequence) in
   fp32 and in bf16 (draft.precision), 3 rounds after a warm-up; the draft's share is a side minus the
   no-draft side of the same policy precision. The policy's logprobs against the rollout's (fp32) are
   reported as the mean KL the trainer logs (``policy/rollout_kl``).

Usage: python scripts/precision_ab.py [ROUNDS]   (default 10; ~8 minutes once the feature cache exists)
"""
import random
import sys
import time
from pathlib import Path

import torch

from codraft.models.bf16 import products
from codraft.policy import load_policy
from codraft.rl.cotrain import cotrain_loss
from codraft.rollout import Engine
from codraft.tasks import make_task
from codraft.train.offline_draft import recipe_for, starting_draft
from codraft.train.packing import pack

from draft_step_ab import offline_setup  # (this folder)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def offline_steps(policy, tok, folder, kind: str, rounds: int, warmup: int = 2) -> dict:
    """Seconds per offline step by side, over rounds after ``warmup`` (the bf16 side compiles its
    buckets' kernels there, as a run does in its first steps). Every step has its own batch and
    anchors, the same on both sides of a round, so row counts change as in a run."""
    draft, features, _ = offline_setup(policy, tok, folder, kind)
    columns, n = draft.teacher_columns(), recipe_for(tok, kind).batch_sequences
    seconds = dict.fromkeys(DTYPES, 0.0)
    for r in range(warmup + rounds):
        for name in (list(DTYPES) if r % 2 else list(DTYPES)[::-1]):
            for step in range(4):
                seed = 4 * r + step
                t = time.perf_counter()
                batch = features.batch(policy, random.Random(seed).sample(range(len(features)), n),
                                       tuple(draft.feature_layers), teacher=draft.reads_teacher, columns=columns)
                draft.zero_grad()
                with products(DTYPES[name]):
                    loss = draft.loss(batch, generator=torch.Generator().manual_seed(seed))[0]
                loss.backward()
                if r >= warmup:
                    seconds[name] += time.perf_counter() - t
    return {k: v / (4 * rounds) for k, v in seconds.items()}


def train_parts(policy, tok, folder, rounds: int) -> dict:
    task = make_task("chain_sum")
    prompts = [tok.prompt_ids(p.prompt) for p in task.sample("train", 2, seed=0) for _ in range(8)]
    out = Engine(policy).generate(prompts, 128, temperature=1.0, seed=0, eos_id=tok.eos_id)
    batch = pack(prompts, [o.tokens for o in out], [o.logprobs for o in out])
    adv = torch.randn(len(prompts), generator=torch.Generator().manual_seed(0))
    draft = starting_draft("dspark", "offline", policy=policy, tok=tok, task=task, policy_dir=Path(folder), gamma=4,
                           seed=0, num_anchors=16)  # the preset's draft (draft.init=offline, draft.num_anchors=16)
    f32, b16 = torch.float32, torch.bfloat16
    sides = {"policy fp32": (None, f32, f32), "policy fp32 + DSpark fp32": (draft, f32, f32),
             "policy fp32 + DSpark bf16": (draft, f32, b16), "policy bf16": (None, b16, f32),
             "policy bf16 + DSpark fp32": (draft, b16, f32), "policy bf16 + DSpark bf16": (draft, b16, b16)}
    seconds, kl = dict.fromkeys(sides, 0.0), {}
    for r in range(rounds + 1):
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            d, policy_dtype, draft_dtype = sides[name]
            policy.zero_grad(set_to_none=True)
            draft.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            t = time.perf_counter()
            loss, m = cotrain_loss(policy, d, batch, adv, temperature=1.0, lam=1.0, eps_low=0.2, eps_high=0.28,
                                   norm="token", policy_dtype=policy_dtype, draft_dtype=draft_dtype)
            loss.backward()
            kl[name] = float(m["policy/rollout_kl"])
            if r:
                seconds[name] += time.perf_counter() - t
    print(f"GRPO batch: {len(prompts)} sequences, {sum(len(o.tokens) for o in out)} completion tokens; "
          f"KL to the rollout's logprobs: fp32 {kl['policy fp32']:.2e}, bf16 products {kl['policy bf16']:.2e}")
    return {k: v / rounds for k, v in seconds.items()}


def main(rounds: int = 10):
    torch.set_num_threads(2)
    policy, tok, folder = load_policy("smollm2-135m")
    policy.eval()
    for kind in ("dspark", "dflash"):
        s = offline_steps(policy, tok, folder, kind, rounds)
        print(f"offline {kind} step: fp32 {s['fp32']:.3f} s, bf16 {s['bf16']:.3f} s, {s['fp32'] / s['bf16']:.2f}x")
    s = train_parts(policy, tok, folder, 3)  # ~50 s a round
    print("train part (loss forward + backward):")
    for k, v in s.items():
        base = s[k.split(" + ")[0]]
        print(f"  {k}: {v:.2f} s" + (f" (draft +{v - base:.2f} s)" if "+" in k else "")
              + (f", {s['policy fp32'] / v:.2f}x policy fp32" if k != "policy fp32" else ""))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
