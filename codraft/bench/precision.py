"""`codraft bench precision`: what bf16 products (``codraft.models.bf16``) save in training on this machine.

``grpo.precision`` / ``draft.precision`` (and the offline recipes' ``precision``) run a loss's matrix
products in fp32 or in bf16 (fp32 accumulation, fp32 master weights); "auto" times bare products once per
machine (``codraft.train.precision``). This times the whole steps they change, same process, the sides of
a round back to back in an order that alternates from round to round, so a slow spell of a shared host
hits them alike:

  grpo     the GRPO step's train part: ``cotrain_loss`` forward + backward on one real rollout batch
           (``prompts`` x ``group`` completions of up to ``max_new_tokens``, T = 1), the policy in fp32 and
           in bf16 products, with no draft and with each draft kind in fp32 and in bf16 (the draft's
           share: a side minus the no-draft side of the same policy precision); also each side's loss and
           the policy's KL to the rollout's own logprobs (``policy/rollout_kl``, what the trainer logs);
  offline  an offline draft step per kind (the recipe's batch from the feature cache ``draft.init=offline``
           trains from: packing, teacher, the loss's forward and backward), fp32 against bf16 products,
           every step on its own batch and anchors, the same on both sides of a round.

Times are medians over the rounds (after ``warmup`` rounds: bf16 pads rows to buckets whose kernels the
first calls compile, as a run's first steps do); "vs fp32" is the median over rounds of the fp32
side's time / this side's in the same round (> 1: bf16 products are faster).
"""
from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from codraft.bench import format_table, machine_info
from codraft.bench.gemv import paired_ratio
from codraft.bench.spec import MODELS
from codraft.drafts import build_draft
from codraft.models.bf16 import products
from codraft.policy import load_policy
from codraft.rl.cotrain import cotrain_loss
from codraft.rollout import Engine
from codraft.tasks import make_task
from codraft.train.offline_draft import (default_task_name, draft_vocabulary, offline_features, recipe_for,
                                         starting_draft)
from codraft.train.packing import pack

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARTS = ("grpo", "offline")


def interleaved(sides: dict[str, Callable[[int], float]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """{side: its float per timed round}: ``warmup + rounds`` rounds, each calling every side with the
    round's index, in the listed order on odd rounds and reversed on even ones; warm-up rounds dropped."""
    out = {name: [] for name in sides}
    for r in range(warmup + rounds):
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            value = sides[name](r)
            if r >= warmup:
                out[name].append(value)
    return out


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def grpo_part(policy, tok, folder, kinds, *, draft_init: str, prompts: int, group: int, max_new_tokens: int,
              rounds: int, warmup: int) -> dict:
    """The GRPO train part's sides, see the module docstring: per side its seconds per round, loss and
    policy-to-rollout KL (the last round's), its median and ``vs_fp32`` against "policy fp32"."""
    task = make_task(default_task_name(tok))
    ids = [tok.prompt_ids(p.prompt) for p in task.sample("train", prompts, seed=0) for _ in range(group)]
    out = Engine(policy).generate(ids, max_new_tokens, temperature=1.0, seed=0, eos_id=tok.eos_id)
    batch = pack(ids, [o.tokens for o in out], [o.logprobs for o in out])
    adv = torch.randn(len(ids), generator=torch.Generator().manual_seed(0))
    drafts = {k: starting_draft(k, draft_init, policy=policy, tok=tok, task=task, policy_dir=Path(folder), gamma=4,
                                seed=0, num_anchors=16) for k in kinds}  # as the real preset's draft
    sides = {}
    for p in DTYPES:
        sides[f"policy {p}"] = (None, DTYPES[p], torch.float32)
        for k in kinds:
            for d in DTYPES:
                sides[f"policy {p} + {k} {d}"] = (drafts[k], DTYPES[p], DTYPES[d])
    seen = {}

    def side(name):
        draft, policy_dtype, draft_dtype = sides[name]

        def step(r):
            policy.zero_grad(set_to_none=True)
            if draft is not None:
                draft.zero_grad(set_to_none=True)
            t = time.perf_counter()
            loss, m = cotrain_loss(policy, draft, batch, adv, temperature=1.0, lam=1.0, eps_low=0.2, eps_high=0.28,
                                   norm="token", policy_dtype=policy_dtype, draft_dtype=draft_dtype,
                                   draft_seed=r)  # the same anchors for every side of a round
            loss.backward()
            seconds = time.perf_counter() - t
            seen[name] = {"loss": float(loss.detach()), "rollout_kl": float(m["policy/rollout_kl"])}
            return seconds
        return step
    times = interleaved({name: side(name) for name in sides}, rounds, warmup)
    rows = {}
    for name, ts in times.items():
        base = name.split(" + ")[0]
        rows[name] = {"seconds": ts, "median_s": statistics.median(ts), **seen[name],
                      "vs_fp32": paired_ratio(times["policy fp32"], ts)}
        if base != name:
            rows[name]["draft_s"] = rows[name]["median_s"] - statistics.median(times[base])
    return {"sequences": len(ids), "completion_tokens": sum(len(o.tokens) for o in out), "sides": rows}


def offline_part(policy, tok, folder, kind: str, *, sequences: int | None, rounds: int, warmup: int) -> dict:
    """An offline ``kind`` step, fp32 against bf16 products: seconds per step (4 steps a round), the
    losses of the last round's steps per side, ``vs_fp32``."""
    recipe = recipe_for(tok, kind)
    torch.manual_seed(0)
    draft = build_draft(kind, policy.config, target=policy, gamma=4, draft_vocab_size=recipe.draft_vocab)
    features = offline_features(policy, tok, make_task(default_task_name(tok)), policy_dir=Path(folder), seed=0,
                                layers=draft.feature_layers, n_prompts=sequences or recipe.n_prompts,
                                max_new_tokens=recipe.max_new_tokens)
    if recipe.draft_vocab:
        draft.set_vocabulary(draft_vocabulary(features, policy.config.vocab_size, recipe.draft_vocab)[0])
    columns = draft.teacher_columns()
    if columns is not None:
        features.teacher_lse(policy)  # once per cache, not a step's work
    n = min(recipe.batch_sequences, len(features))
    losses = {name: [] for name in DTYPES}

    def side(name):
        def steps(r):
            total, losses[name] = 0.0, []
            for s in range(4):
                seed = 4 * r + s
                t = time.perf_counter()
                batch = features.batch(policy, random.Random(seed).sample(range(len(features)), n),
                                       tuple(draft.feature_layers), teacher=draft.reads_teacher, columns=columns)
                draft.zero_grad()
                with products(DTYPES[name]):
                    loss = draft.loss(batch, generator=torch.Generator().manual_seed(seed))[0]
                loss.backward()
                total += time.perf_counter() - t
                losses[name].append(float(loss.detach()))
            return total / 4
        return steps
    times = interleaved({name: side(name) for name in DTYPES}, rounds, warmup)
    return {"kind": kind, "sequences": len(features), "batch_sequences": n,
            "sides": {name: {"seconds": ts, "median_s": statistics.median(ts), "losses": losses[name],
                             "vs_fp32": paired_ratio(times["fp32"], ts)} for name, ts in times.items()}}


def run(model_name: str = "smollm2", parts=PARTS, drafts=("dspark",), offline_kinds=("dspark", "dflash"),
        draft_init: str = "offline", prompts: int = 2, group: int = 8, max_new_tokens: int = 128,
        sequences: int | None = None, rounds: int = 3, warmup: int = 1, threads: int = 2,
        json_path: str | None = None) -> dict:
    bad = sorted(set(parts) - set(PARTS))
    if bad or not parts:
        raise ValueError(f"--parts: {', '.join(bad) or 'none given'}; choose from {', '.join(PARTS)}")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"--rounds must be >= 1 and --warmup >= 0, got {rounds} and {warmup}")
    torch.set_num_threads(threads)
    policy, tok, folder = load_policy(MODELS.get(model_name, model_name))
    policy.eval()
    report = {"settings": {"model": model_name, "parts": list(parts), "drafts": list(drafts),
                           "offline_kinds": list(offline_kinds), "draft_init": draft_init, "prompts": prompts,
                           "group": group, "max_new_tokens": max_new_tokens, "sequences": sequences,
                           "rounds": rounds, "warmup": warmup, "threads": threads},
              "machine": machine_info(kernels=False)}
    print(f"bench precision: {model_name}, {threads} threads, {report['machine']['processor']} "
          f"({report['machine']['cpu_capability']}); median over {rounds} rounds after {warmup} of warm-up")
    if "offline" in parts:
        report["offline"] = [offline_part(policy, tok, folder, k, sequences=sequences, rounds=rounds, warmup=warmup)
                             for k in offline_kinds]
        print("offline draft step, s (the recipe's batch: packing, teacher, loss forward + backward):")
        print(format_table([[o["kind"], o["sides"]["fp32"]["median_s"], o["sides"]["bf16"]["median_s"],
                             o["sides"]["bf16"]["vs_fp32"]] for o in report["offline"]],
                           ["kind", "fp32", "bf16 products", "bf16 vs fp32"]))
    if "grpo" in parts:
        g = report["grpo"] = grpo_part(policy, tok, folder, list(drafts), draft_init=draft_init, prompts=prompts,
                                       group=group, max_new_tokens=max_new_tokens, rounds=rounds, warmup=warmup)
        print(f"GRPO train part (cotrain_loss forward + backward), {g['sequences']} sequences, "
              f"{g['completion_tokens']} completion tokens, s:")
        print(format_table([[name, s["median_s"], s.get("draft_s"), s["vs_fp32"], s["rollout_kl"]]
                            for name, s in g["sides"].items()],
                           ["side", "median", "draft's share", "vs policy fp32", "KL to rollout"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return report
