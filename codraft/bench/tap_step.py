"""`codraft bench tap --step`: what the taps cost a pipeline-parallel co-training step.

The same PP step (``codraft.rl.pipelined``, over ``codraft.parallel.pipelined``: 1F1B over M micro-batches,
gradient sums, clipping) is timed with the draft disabled (``none``: the policy alone, no taps), and with a DFlash draft
whose taps reach the last stage over TapChannel (``shm``, ``p2p``) or the baselines (``staging``:
pickled through the host; ``relay``: appended to the activations inside the schedule). The
difference between a tap transport and ``none`` is the draft's loss plus the transport, so each
row also reports its ratio to ``shm``: the transport's share once the draft's work is the same.

Setup: P stage processes (``--stages``), gloo on 127.0.0.1, one intra-op thread each; a random
policy of the tiny preset's shape (or ``--shape LAYERSxHIDDEN``), GRPO-shaped rollouts of
``--groups`` prompts × 4 completions. Step time is the slowest stage's, median over ``--repeats``.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from codraft.bench import machine_info
from codraft.drafts import init_draft
from codraft.models import ModelConfig, Transformer
from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel.spawn import raise_errors, spawn_ranks
from codraft.rl.microbatch import split_microbatches
from codraft.parallel.gradients import clip_stage_gradients, reduce_stage_gradients
from codraft.parallel.stages import build_pipeline
from codraft.rl.pipelined import pipeline_cotrain

METHODS = ("none", "shm", "p2p", "staging", "relay")
LOSS_KW = dict(temperature=1.0, lam=0.5, eps_low=0.2, eps_high=0.28, norm="token")


def _rollouts(groups: int, group_size: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts, completions, logprobs = [], [], []
    for _ in range(groups):
        p = torch.randint(3, vocab, (int(torch.randint(40, 120, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            m = int(torch.randint(20, 64, (1,), generator=g))
            completions.append(torch.randint(3, vocab, (m,), generator=g).tolist())
            logprobs.append((-torch.rand(m, generator=g) * 3).tolist())
            prompts.append(p)
    return prompts, completions, logprobs, torch.randn(len(prompts), generator=g)


def _rank_main(rank, world, cfg):
    torch.set_num_threads(1)
    mesh = build_mesh(Layout(pp=world, cp=1), timeout=cfg["timeout"])
    layers, hidden = cfg["shape"]
    heads = max(hidden // 64, 1)  # SmolLM2's head layout at 576: 9 heads of 64, 3 KV heads
    mc = ModelConfig(vocab_size=cfg["vocab"], hidden_size=hidden, intermediate_size=3 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, head_dim=64,
                     num_key_value_heads=3 if heads % 3 == 0 else 1, rope_theta=10000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, max_position_embeddings=1024)
    torch.manual_seed(0)
    policy = Transformer(mc)
    draft = init_draft("dflash", policy, gamma=4, num_anchors=16)
    mbs = split_microbatches(*_rollouts(cfg["groups"], 4, cfg["vocab"]), 4, cfg["microbatches"], "cpu")
    rows = []
    for method in cfg["methods"]:
        d = None if method == "none" else draft
        pipe = build_pipeline(policy, d, mesh, transport="shm" if method == "none" else method,
                              max_tokens=4096, timeout=cfg["timeout"])
        times = []
        for i in range(cfg["warmup"] + cfg["repeats"]):
            policy.zero_grad(set_to_none=True)
            draft.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            pipeline_cotrain(pipe, policy, d, mbs, step=i, **LOSS_KW)
            own, drafts = reduce_stage_gradients(pipe, policy, [] if d is None else list(draft.trainable_parameters()))
            clip_stage_gradients(pipe, policy, own, drafts, 1.0, None if d is None else 1.0)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i >= cfg["warmup"]:
                times.append(float(took))
        if pipe.channel is not None:
            pipe.channel.close()
        rows.append({"method": method, "stages": world, "microbatches": cfg["microbatches"], "layers": layers,
                     "hidden": hidden, "taps": len(draft.feature_layers), "step_s": statistics.median(times),
                     "runs_s": times})
    return rows


def run(stages: int = 2, shape: tuple[int, int] = (4, 128), groups: int = 8, microbatches: int = 4,
        methods=METHODS, repeats: int = 5, warmup: int = 1, json_path: str | None = None,
        timeout: float = 120.0) -> list[dict]:
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}: choose from {', '.join(METHODS)}")
    if "none" not in methods or "shm" not in methods:
        methods = ["none", "shm", *[m for m in methods if m not in ("none", "shm")]]  # the baselines of the ratios
    if stages < 2 or shape[0] < stages or not 1 <= microbatches <= groups or repeats < 1:
        raise ValueError("need stages >= 2, layers >= stages, 1 <= microbatches <= groups, repeats >= 1")
    cfg = {"shape": tuple(shape), "groups": groups, "microbatches": microbatches, "methods": list(methods),
           "repeats": repeats, "warmup": warmup, "timeout": timeout, "vocab": 256}
    info = machine_info(kernels=False)  # training steps: no decode kernels
    info.update(threads_per_rank=1, backend="gloo")
    print(f"bench tap --step: {info['processor']}, {info['cpu_count']} CPUs, torch {info['torch']}; {stages} stages, "
          f"{shape[0]} layers × {shape[1]} hidden, {groups}×4 rollouts in {microbatches} micro-batches, "
          f"median of {repeats}", flush=True)
    results, errors = spawn_ranks(_rank_main, stages, cfg, timeout=timeout * 8, pg_timeout=timeout)
    raise_errors(errors, "bench tap --step")
    rows = results[0]
    base = {r["method"]: r["step_s"] for r in rows}
    head = f"{'method':>8} {'step ms':>9} {'vs none':>8} {'vs shm':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        r.update(vs_none=r["step_s"] / base["none"], vs_shm=r["step_s"] / base["shm"],
                 processor=info["processor"], torch=info["torch"])
        lines.append(f"{r['method']:>8} {r['step_s'] * 1e3:>9.1f} {r['vs_none']:>7.2f}x {r['vs_shm']:>6.2f}x")
    print("\n".join(lines))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"bench": "tap-step", "machine": info, "config": cfg, "rows": rows}, f, indent=2)
        print(f"wrote {json_path}")
    return rows
