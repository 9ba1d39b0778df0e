"""`codraft bench tap`: fan-in of tapped features from producer stages to the last pipeline stage,
TapChannel over shared memory vs TapChannel point-to-point vs host staging vs relay.

Why: the draft on the last stage needs hidden states of layers on earlier stages every
micro-batch; this measures what the side channel costs against what one would do without one,
``staging``: each tensor pickled through ``send_object_list``/``recv_object_list`` (a fresh
allocation, a pickle and a copy per message, no pre-allocated slots; ``parallel/tap_staging.py``);
``relay``: the taps travel the chain of stages, each appending its own to what it received (what a
pipeline without a side channel does with its activations), so early stages' taps cross every later link.

Setup: P producer processes (``--producers``) and one consumer, spawned, gloo over TCP on
127.0.0.1, one intra-op thread each. The taps (``--taps``, default 3) are spread round-robin over
the producers; each feature is tokens × hidden fp32 (``--sizes``, e.g. 2048x576: SmolLM2-135M's
hidden size; 2048x128: the tiny model's). A round: every process leaves a barrier, the producers
put every tap of M micro-batches, the consumer gets them all (out of a window of ``in_flight`` = 2
slots per tap for the channels); the consumer's wall time from the barrier to its last get.

* ``latency_s``: one micro-batch (M = 1), median over ``--repeats``.
* ``bandwidth_gbps``: bytes of M = ``--microbatches`` micro-batches over the round's time, median.
* ``speedup_vs_staging``: staging's latency over the method's.

With more processes than cores (P + 1 > cores) the figures include scheduling: the row says
``processes`` and the JSON the machine's CPU count.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from codraft.bench import machine_info
from codraft.parallel.spawn import raise_errors, spawn_ranks
from codraft.parallel.tap_staging import open_staging_channel
from codraft.parallel.tapchannel import TapSpec, open_tap_channel

METHODS = ("shm", "p2p", "staging", "relay")


def parse_size(text: str) -> tuple[int, int]:
    tokens, hidden = text.lower().split("x")
    return int(tokens), int(hidden)


def _round(method, ch, rank, world, taps_of, tokens, hidden, mbs, feats, step):
    consumer = world - 1
    dist.barrier()
    t0 = time.perf_counter()
    if method == "relay":  # a chain: each stage receives the earlier stages' taps, appends its own, sends on
        before = sum(len(t) for t in taps_of[:rank])
        for mb in range(mbs):
            parts = []
            if rank > 0:
                carried = torch.empty(tokens, hidden * before)
                dist.recv(carried, rank - 1)
                parts.append(carried)
            if rank != consumer:
                dist.send(torch.cat(parts + [feats[t] for t in taps_of[rank]], -1), rank + 1)
            else:
                assert carried.shape == (tokens, hidden * before)
    elif rank != consumer:
        for mb in range(mbs):
            for tap in taps_of[rank]:
                ch.put(step, mb, tap, feats[tap])
    else:
        for mb in range(mbs):
            for src in range(world - 1):
                for tap in taps_of[src]:
                    assert ch.get(step, mb, tap).shape == (tokens, hidden)
    return time.perf_counter() - t0


def _rank_main(rank, world, cfg):
    rows = []
    producers = world - 1
    taps = list(range(cfg["taps"]))
    taps_of = [taps[p::producers] for p in range(producers)] + [[]]
    for tokens, hidden in cfg["sizes"]:
        g = torch.Generator().manual_seed(rank)
        feats = {t: torch.randn(tokens, hidden, generator=g) for t in taps}
        for method in cfg["methods"]:
            spec = TapSpec(max_tokens=tokens, hidden=hidden, taps=tuple(tuple(t) for t in taps_of),
                           in_flight=2, timeout=cfg["timeout"])
            ch = None if method == "relay" else open_staging_channel(spec, list(range(world))) \
                if method == "staging" else open_tap_channel(spec, method)
            step = 0
            lat, bw = [], []
            for i in range(cfg["warmup"] + cfg["repeats"]):
                a = _round(method, ch, rank, world, taps_of, tokens, hidden, 1, feats, step)
                b = _round(method, ch, rank, world, taps_of, tokens, hidden, cfg["microbatches"], feats, step + 1)
                step += 2
                if i >= cfg["warmup"]:
                    lat.append(a)
                    bw.append(b)
            if ch is not None:
                ch.close()
            dist.barrier()
            if rank == world - 1:
                mb_bytes = len(taps) * tokens * hidden * 4
                rows.append({"method": method, "tokens": tokens, "hidden": hidden, "taps": len(taps),
                             "producers": producers, "processes": world, "dtype": "float32",
                             "bytes_per_microbatch": mb_bytes, "microbatches": cfg["microbatches"],
                             "latency_s": statistics.median(lat), "latency_runs_s": lat,
                             "bandwidth_gbps": mb_bytes * cfg["microbatches"] / statistics.median(bw) / 1e9,
                             "stream_runs_s": bw})
    return rows


def _spawn(world: int, cfg: dict) -> list:
    results, errors = spawn_ranks(_rank_main, world, cfg, timeout=cfg["deadline"], pg_timeout=cfg["timeout"])
    raise_errors(errors, "bench tap")
    return results[world - 1]


def _table(rows: list[dict]) -> str:
    head = f"{'size':>12} {'method':>8} {'latency ms':>11} {'GB/s':>7} {'vs staging':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r['tokens']}x{r['hidden']}x{r['taps']}"
        lines.append(f"{size:>12} {r['method']:>8} {r['latency_s'] * 1e3:>11.3f} {r['bandwidth_gbps']:>7.3f} "
                     f"{r.get('speedup_vs_staging', float('nan')):>9.2f}x")
    return "\n".join(lines)


def run(sizes=((2048, 576), (2048, 128)), methods=METHODS, producers: int = 2, taps: int = 3,
        microbatches: int = 8, repeats: int = 5, warmup: int = 1, json_path: str | None = None,
        timeout: float = 120.0) -> list[dict]:
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}: choose from {', '.join(METHODS)}")
    if producers < 1 or taps < producers or microbatches < 1 or repeats < 1 or warmup < 0:
        raise ValueError("need producers >= 1, taps >= producers, microbatches/repeats >= 1, warmup >= 0")
    cfg = {"sizes": [tuple(s) for s in sizes], "methods": list(methods), "taps": taps,
           "microbatches": microbatches, "repeats": repeats, "warmup": warmup, "timeout": timeout,
           "deadline": timeout * 4}
    info = machine_info(kernels=False)  # training steps: no decode kernels
    info.update(threads_per_rank=1, backend="gloo")
    print(f"bench tap: {info['processor']}, {info['cpu_count']} CPUs, torch {info['torch']}; {producers} producer(s) "
          f"+ 1 consumer, {taps} taps fp32, median of {repeats}", flush=True)
    rows = _spawn(producers + 1, cfg)
    for r in rows:
        base = next((b for b in rows if b["method"] == "staging" and b["tokens"] == r["tokens"]
                     and b["hidden"] == r["hidden"]), None)
        r["speedup_vs_staging"] = base["latency_s"] / r["latency_s"] if base else float("nan")
        r.update(processor=info["processor"], torch=info["torch"])
    print(_table(rows))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"bench": "tap", "machine": info, "config": {k: v for k, v in cfg.items() if k != "deadline"},
                       "rows": rows}, f, indent=2)
        print(f"wrote {json_path}")
    return rows
