"""`codraft bench cp`: one attention layer's forward + backward under context parallelism, zigzag
ring vs USP vs plain ring vs all-gather K/V, on real gloo process groups of C CPU processes.

Workload, per total length N (tokens of one packed row): sequence lengths drawn (seeded) between
N/8 and N/2, the last one filling the row; the tiny policy's attention shape (4 query heads over 2
KV heads, head_dim 64, ``tiny_model_config``), fp32, batch 1. Branch shapes (``--branch``):

* ``none``: the main causal attention only.
* ``eagle3``: main causal attention plus k = 3 EAGLE-3 TTT steps; step j's queries (one per row)
  attend the same main K/V through the method's causal attention (a full CP call each: in
  training the steps are unrolled one after another, so they cannot share one ring pass), merged
  by ``merge_lse`` with the local diagonal part (``branch_local_part(..., local="diagonal")``)
  over the row's own steps 1..j.
* ``dflash``: main causal attention plus DFlash blocks: 16 anchors per sequence (seeded), block 8,
  each block on its anchor's rank; main part by the method's branch attention
  (``ring_branch_attention`` for zigzag), local part ``local="block"``, merged. USP has no branch
  placement (``baselines`` docstring): its rows say n/a.

Methods (``--methods``): ``zigzag`` (``ring.ring_attention``), ``usp`` (Ulysses U = C: at C = 4
the 2 KV heads are padded to 4 and the query heads to 8), ``ring`` (plain contiguous ring),
``allgather`` (``parallel.baselines``). All compute their blocks with the same kernels
(``parallel.blocks``). At C = 1 the rows are ``single`` (one process: one causal block per
sequence, no communication; every method's parallel efficiency is against it) and the methods
of ``--c1-methods`` (default zigzag) with their own C = 1 code: ``eff_same_code`` is
T_method(1) / (C·T_method(C)) where that was measured.

Processes: C spawned processes per C, gloo over TCP on 127.0.0.1, **one intra-op thread per rank**
(``torch.set_num_threads(1)``), so C = 1 uses one core, C = 2 both cores of a 2-core machine, and
C = 4 oversubscribes it (reported, not meaningful for efficiency). Methods are interleaved within
every repeat (repeat 1: all methods, repeat 2: all methods, ...), after ``--warmup`` untimed
rounds, so that the load of other processes falls on all of them alike; ``others_cores`` is the
mean number of cores other processes used meanwhile (from /proc/stat).

Figures per (method, C, length, branch):

* ``latency_s``: forward + backward wall time, max over ranks (ranks start after a barrier),
  median over repeats; ``fwd_s`` likewise for the forward alone.
* ``peak_mem_bytes``: per-rank peak resident memory of the step, max over ranks: VmHWM after
  resetting it (``echo 5 > /proc/self/clear_refs``) minus VmRSS at the reset, so it counts the
  inputs, saved activations, communication buffers, score chunks and gradients, not the
  interpreter. glibc's mmap threshold is pinned to 64 KiB in the workers (``mallopt``), so freed
  tensors leave the RSS, and the heap's free pages are returned before each reset (``malloc_trim``), so each
  repeat's peak is its own. Max over repeats.
* ``sent_bytes`` / ``sent_fwd_bytes``: bytes each rank sent (max over ranks), forward + backward
  and forward only: ``Group.sent_bytes`` (the ring's point-to-point) plus the collectives'
  bytes as ``baselines`` counts them. ``formula_fwd_bytes`` (ring methods): passes·2(C−1)·N/C·
  d_kv·b with N/C the padded local rows, d_kv = Hkv·D, b = 4 bytes, passes = ring calls per step.
* ``efficiency``: T_single(1) / (C·T(C)); ``speedup_vs_usp``: T_usp(C) / T(C); ``mem_vs_c1``:
  peak / peak of ``single`` at C = 1; ``mem_vs_usp``: peak / USP's at the same C.
* ``cpu_s``: CPU seconds of the step on the busiest rank (max over ranks, median over repeats),
  and ``cpu_efficiency`` / ``cpu_speedup_vs_usp`` computed from it like the wall-clock ones. A
  rank waiting for a peer sleeps (gloo blocks), so this is the compute on the critical rank: what
  the latency would be with a core per rank and free communication. On a shared machine it is
  the figure that other processes do not move; ``rank_cpu_s`` shows the balance between ranks.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from codraft.attention import branch_local_part, merge_lse
from codraft.bench import CpuMeter, format_table, machine_info
from codraft.parallel.baselines import (METHODS, ContiguousPlan, ContiguousShard, comm_bytes, plain_ring_attention,
                                        plain_ring_branch_attention, reset_comm_bytes)
from codraft.parallel.comm import Group
from codraft.parallel.spawn import raise_errors, spawn_ranks
from codraft.rl.memory import proc_status, reset_resident_peak

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64  # tiny_model_config's attention shape
TTT_STEPS = 3
DFLASH_ANCHORS, DFLASH_BLOCK = 16, 8
BRANCHES = ("none", "eagle3", "dflash")
RING_METHODS = ("zigzag", "ring")


def packing(total: int, seed: int = 0) -> list[int]:
    """Sequence lengths of one packed row of ``total`` tokens: drawn in [total/8, total/2], the
    last one filling the row (never shorter than total/8: a short remainder joins the last draw)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + total)
    lo, hi = max(1, total // 8), max(1, total // 2)
    out, rest = [], total
    while rest > 0:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        n = rest if rest - n < lo else n
        out.append(n)
        rest -= n
    return out


def check_method(name: str) -> None:
    if name not in METHODS and name != "single":
        raise ValueError(f"unknown CP method {name!r}: choose from {', '.join(METHODS)} (single: C = 1 only)")


# ---- one rank -------------------------------------------------------------------------------


class _Setup:
    """One method on one rank for one row: plan, shard, attention functions, branch inputs."""

    def __init__(self, method: str, cu: torch.Tensor, total: int, rank: int, world: int, branch: str,
                 anchors_global: torch.Tensor):
        self.spec = base = method
        if base == "single":
            self.plan = ContiguousPlan.of(cu, world, total)
            self.shard = ContiguousShard(self.plan, rank)
            self.attention, self.branch = plain_ring_attention, plain_ring_branch_attention
        else:
            m = METHODS[base]
            self.plan = m.plan(cu, world, total)
            self.shard = m.shard(self.plan, rank)
            self.attention, self.branch = m.attention, m.branch
        self.method = base
        self.supported = branch != "dflash" or self.branch is not None
        self.passes = {"none": 1, "eagle3": 1 + TTT_STEPS, "dflash": 2}[branch]
        self.anchors = None
        if branch == "dflash":
            index = self.shard.index
            local_of = torch.full((total,), -1, dtype=torch.long)
            local_of[index[index >= 0]] = (index >= 0).nonzero()[:, 0]
            a = local_of[anchors_global]
            self.anchors = a[a >= 0]


def _inputs(s: _Setup, branch: str, gen: torch.Generator) -> dict:
    t = s.plan.local_len
    r = lambda *shape: torch.randn(*shape, generator=gen).requires_grad_()
    x = {"q": r(1, HEADS, t, HEAD_DIM), "k": r(1, KV_HEADS, t, HEAD_DIM), "v": r(1, KV_HEADS, t, HEAD_DIM)}
    if branch == "eagle3":
        x["qs"] = [r(1, HEADS, t, HEAD_DIM) for _ in range(TTT_STEPS)]
        x["kb"], x["vb"] = r(1, KV_HEADS, t, TTT_STEPS, HEAD_DIM), r(1, KV_HEADS, t, TTT_STEPS, HEAD_DIM)
    elif branch == "dflash":
        n = s.anchors.numel()
        x["qb"] = r(1, HEADS, n, DFLASH_BLOCK, HEAD_DIM)
        x["kb"], x["vb"] = r(1, KV_HEADS, n, DFLASH_BLOCK, HEAD_DIM), r(1, KV_HEADS, n, DFLASH_BLOCK, HEAD_DIM)
    return x


def _forward(s: _Setup, branch: str, x: dict, comm: Group) -> list[torch.Tensor]:
    o, _ = s.attention(x["q"], x["k"], x["v"], s.shard, comm)
    outs = [o]
    if branch == "eagle3":
        for j, qj in enumerate(x["qs"], start=1):
            om, lm = s.attention(qj, x["k"], x["v"], s.shard, comm)
            ob, lb = branch_local_part(qj[:, :, :, None], x["kb"][:, :, :, :j], x["vb"][:, :, :, :j], local="diagonal")
            outs.append(merge_lse(om[:, :, :, None], lm[:, :, :, None], ob, lb)[0])
    elif branch == "dflash":
        om, lm = s.branch(x["qb"], x["k"], x["v"], s.anchors, s.shard, comm, include_anchor=False)
        ob, lb = branch_local_part(x["qb"], x["kb"], x["vb"], local="block")
        outs.append(merge_lse(om, lm, ob, lb)[0])
    return outs


def _measure(s: _Setup, branch: str, comm: Group, gen: torch.Generator) -> dict:
    gc.collect()
    _trim_heap()
    dist.barrier()
    exact = reset_resident_peak()
    base = proc_status("VmRSS")
    x = _inputs(s, branch, gen)
    grads = None
    reset_comm_bytes(comm)
    dist.barrier()
    busy0, cpu0, t0 = CpuMeter._machine_busy_s() or 0.0, time.process_time(), time.perf_counter()
    outs = _forward(s, branch, x, comm)
    t1 = time.perf_counter()
    fwd_bytes = comm_bytes(comm)
    grads = [torch.randn(o.shape, generator=gen) for o in outs]  # (the draw is outside the timed spans)
    t1b = time.perf_counter()
    torch.autograd.backward(outs, grads)
    t2 = time.perf_counter()
    cpu, busy = time.process_time() - cpu0, (CpuMeter._machine_busy_s() or 0.0) - busy0
    rec = {"fwd_s": t1 - t0, "total_s": (t1 - t0) + (t2 - t1b), "wall_s": t2 - t0, "cpu_s": cpu, "busy_s": busy,
           "peak_bytes": proc_status("VmHWM") - base, "peak_exact": exact, "base_rss": base, "sent_fwd": fwd_bytes,
           "sent": comm_bytes(comm)}
    del outs, grads, x
    return rec


def _rank_main(rank: int, world: int, cfg: dict) -> list[dict]:
    comm = Group.world(timeout=cfg["timeout"])
    gen = torch.Generator().manual_seed(1000 + rank)
    records = []
    specs = cfg["c1_methods"] if world == 1 else cfg["methods"]
    wcu = torch.tensor([0, 100, 256])
    for sp in specs:  # warm-up: first calls (lazy init, gloo connections) stay out of the figures
        for branch in cfg["branches"]:
            s = _Setup(sp, wcu, 256, rank, world, branch, torch.tensor([5, 50, 150, 200]))
            if s.supported:
                _measure(s, branch, comm, gen)
    for total in cfg["lengths"]:
        lens = packing(total, cfg["seed"])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        ga = torch.Generator().manual_seed(cfg["seed"] + 7)
        anchors = torch.cat([cu[i] + torch.randint(0, n, (DFLASH_ANCHORS,), generator=ga)
                             for i, n in enumerate(lens)]).sort().values
        for branch in cfg["branches"]:
            setups = [_Setup(sp, cu, total, rank, world, branch, anchors) for sp in specs]
            for rep in range(cfg["warmup"] + cfg["repeats"]):
                for s in setups:
                    if not s.supported:
                        if rep == 0:
                            records.append({"spec": s.spec, "length": total, "branch": branch, "rep": -1})
                        continue
                    rec = _measure(s, branch, comm, gen)
                    if rep >= cfg["warmup"]:
                        records.append({"spec": s.spec, "length": total, "branch": branch, "rep": rep, **rec,
                                        "local_len": s.plan.local_len, "padding_ratio": s.plan.padding_ratio,
                                        "sequences": len(lens), "passes": s.passes,
                                        "method": s.method, "ulysses": getattr(s.plan, "ulysses", None)})
                    if rank == 0 and cfg["verbose"]:
                        print(f"  C={world} N={total} {branch} {s.spec} rep {rep}: {rec['total_s']:.2f} s",
                              flush=True)
    return records


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # (not glibc)
        return None


def _limit_malloc() -> None:
    if libc := _libc():  # M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1: big frees go back to the OS at once
        libc.mallopt(-3, 64 * 1024)
        libc.mallopt(-1, 128 * 1024)


def _trim_heap() -> None:
    """Free heap pages back to the OS (malloc_trim): the small tensors of the step then grow the RSS whatever the
    process freed before (a rank forked from a busy process holds resident free chunks they would reuse)."""
    if libc := _libc():
        libc.malloc_trim(0)


def _spawn(world: int, cfg: dict) -> list[list[dict]]:
    results, errors = spawn_ranks(_rank_main, world, cfg, timeout=cfg["deadline"], pg_timeout=cfg["timeout"],
                                  setup=_limit_malloc)
    raise_errors(errors, "bench cp")
    return [results[r] for r in range(world)]


# ---- aggregation ----------------------------------------------------------------------------


def _aggregate(world: int, per_rank: list[list[dict]]) -> list[dict]:
    """Rank records -> one row per (spec, length, branch)."""
    keys = []
    by = {}
    for r, recs in enumerate(per_rank):
        for rec in recs:
            k = (rec["spec"], rec["length"], rec["branch"])
            if k not in by:
                keys.append(k)
                by[k] = {}
            by[k].setdefault(rec["rep"], {})[r] = rec
    rows = []
    for k in keys:
        spec, length, branch = k
        reps = by[k]
        if -1 in reps:
            rows.append({"method": spec, "cp": world, "length": length, "branch": branch, "supported": False})
            continue
        per = [reps[i] for i in sorted(reps)]  # per repeat: rank -> record
        lat = [max(x["total_s"] for x in rr.values()) for rr in per]
        fwd = [max(x["fwd_s"] for x in rr.values()) for rr in per]
        wall = [max(x["wall_s"] for x in rr.values()) for rr in per]
        others = [max(0.0, (max(x["busy_s"] for x in rr.values()) - sum(x["cpu_s"] for x in rr.values())) / w)
                  for rr, w in zip(per, wall)]
        first = per[0][0]
        row = {
            "method": spec, "base": first["method"], "cp": world, "length": length, "branch": branch,
            "supported": True, "ulysses": first["ulysses"], "sequences": first["sequences"],
            "local_len": first["local_len"], "padding_ratio": first["padding_ratio"], "passes": first["passes"],
            "repeats": len(per),
            "latency_s": statistics.median(lat), "latency_runs_s": lat, "fwd_s": statistics.median(fwd),
            "cpu_s": statistics.median(max(x["cpu_s"] for x in rr.values()) for rr in per),
            "rank_cpu_s": [statistics.median(rr[r]["cpu_s"] for rr in per) for r in range(world)],
            "peak_mem_bytes": max(x["peak_bytes"] for rr in per for x in rr.values()),
            "rank_peak_mem_bytes": [max(rr[r]["peak_bytes"] for rr in per) for r in range(world)],
            "peak_mem_exact": all(x["peak_exact"] for rr in per for x in rr.values()),
            "sent_bytes": max(x["sent"] for rr in per for x in rr.values()),
            "sent_fwd_bytes": max(x["sent_fwd"] for rr in per for x in rr.values()),
            "others_cores": statistics.median(others),
        }
        row["formula_fwd_bytes"] = (row["passes"] * 2 * (world - 1) * row["local_len"] * KV_HEADS * HEAD_DIM * 4
                                    if row["base"] in RING_METHODS else None)
        rows.append(row)
    return rows


def _derive(rows: list[dict]) -> None:
    """Efficiency, speedup vs USP, memory ratios: filled in place where the peers were measured."""
    def find(method, cp, length, branch):
        for r in rows:
            if (r["method"], r["cp"], r["length"], r["branch"]) == (method, cp, length, branch) and r["supported"]:
                return r
        return None

    for r in rows:
        if not r["supported"]:
            continue
        one = find("single", 1, r["length"], r["branch"])
        own = find(r["method"], 1, r["length"], r["branch"])
        usp = find("usp", r["cp"], r["length"], r["branch"])
        c = r["cp"]
        r["efficiency"] = one["latency_s"] / (c * r["latency_s"]) if one else None
        r["cpu_efficiency"] = one["cpu_s"] / (c * r["cpu_s"]) if one else None
        r["eff_same_code"] = own["latency_s"] / (c * r["latency_s"]) if own else None
        r["speedup_vs_usp"] = usp["latency_s"] / r["latency_s"] if usp else None
        r["cpu_speedup_vs_usp"] = usp["cpu_s"] / r["cpu_s"] if usp else None
        r["mem_vs_c1"] = r["peak_mem_bytes"] / one["peak_mem_bytes"] if one and one["peak_mem_bytes"] > 0 else None
        r["mem_vs_usp"] = r["peak_mem_bytes"] / usp["peak_mem_bytes"] if usp and usp["peak_mem_bytes"] > 0 else None


def _table(rows: list[dict]) -> str:
    mb = lambda b: None if b is None else b / 2 ** 20
    out = []
    for r in rows:
        if not r["supported"]:
            out.append([r["method"], r["cp"], r["length"], r["branch"]] + ["n/a"] + [None] * 13)
            continue
        out.append([r["method"], r["cp"], r["length"], r["branch"], r["latency_s"], r["fwd_s"], r["efficiency"],
                    r["speedup_vs_usp"], r["cpu_s"], r["cpu_efficiency"], r["cpu_speedup_vs_usp"],
                    mb(r["peak_mem_bytes"]), r["mem_vs_c1"], r["mem_vs_usp"],
                    mb(r["sent_bytes"]), mb(r["sent_fwd_bytes"]), mb(r["formula_fwd_bytes"]), r["others_cores"]])
    return format_table(out, ["method", "C", "tokens", "branch", "fwd+bwd s", "fwd s", "eff", "x usp", "cpu s",
                              "cpu eff", "cpu x usp", "peak MB", "mem/C1", "mem/usp", "sent MB", "fwd MB",
                              "formula MB", "others"])


def run(lengths=(8192, 16384, 32768, 65536), cps=(1, 2, 4), methods=("zigzag", "usp", "ring", "allgather"),
        branches=("none", "eagle3", "dflash"), repeats: int = 3, warmup: int = 1, seed: int = 0,
        c1_methods=("single", "zigzag"), json_path: str | None = None, append: bool = False,
        timeout: float = 1800.0, verbose: bool = True) -> list[dict]:
    for b in branches:
        if b not in BRANCHES:
            raise ValueError(f"unknown branch shape {b!r}: choose from {', '.join(BRANCHES)}")
    for m in (*methods, *c1_methods):
        check_method(m)
    if "single" in methods:
        raise ValueError("single is the one-process reference: list it in --c1-methods")
    if any(c < 1 for c in cps) or any(n < 2 for n in lengths) or repeats < 1 or warmup < 0:
        raise ValueError("--cp, --lengths, --repeats must be positive (--warmup >= 0)")
    cfg = {"lengths": list(lengths), "methods": list(methods), "c1_methods": list(c1_methods),
           "branches": list(branches), "repeats": repeats, "warmup": warmup, "seed": seed,
           "timeout": timeout, "deadline": timeout * 4, "verbose": verbose}
    info = machine_info(kernels=False)  # training steps: no decode kernels
    info.update(threads_per_rank=1, backend="gloo")
    print(f"bench cp: {info['processor']}, {info['cpu_count']} CPUs, torch {info['torch']}; 1 intra-op thread per "
          f"rank; heads {HEADS}/{KV_HEADS} x {HEAD_DIM}, fp32; median of {repeats} after {warmup} warm-up", flush=True)
    rows = []
    t_start = time.perf_counter()
    for c in cps:
        rows += _aggregate(c, _spawn(c, cfg))
    run_info = {k: v for k, v in cfg.items() if k not in ("verbose", "deadline")} | {
        "cps": list(cps), "packings": {str(n): packing(n, seed) for n in lengths}, "machine": info,
        "wall_s": time.perf_counter() - t_start}
    for r in rows:
        r.update(processor=info["processor"], torch=info["torch"], threads_per_rank=1)
    runs = [run_info]
    if append and json_path and os.path.exists(json_path):  # merge; a row measured again replaces its old one
        with open(json_path) as f:
            old = json.load(f)
        key = lambda r: (r["method"], r["cp"], r["length"], r["branch"])
        new = {key(r) for r in rows}
        rows = [r for r in old["rows"] if key(r) not in new] + rows
        runs = old.get("runs", []) + runs
    order = {m: i for i, m in enumerate(("single", "zigzag", "usp", "ring", "allgather"))}
    rows.sort(key=lambda r: (r["length"], BRANCHES.index(r["branch"]), r["cp"], order.get(r["method"], 99)))
    _derive(rows)
    print(_table(rows))
    if json_path:
        payload = {"bench": "cp", "machine": info,
                   "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
                             "ttt_steps": TTT_STEPS, "dflash_anchors_per_sequence": DFLASH_ANCHORS,
                             "dflash_block": DFLASH_BLOCK},
                   "runs": runs, "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {json_path}")
    return rows
