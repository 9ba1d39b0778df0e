"""`codraft bench dp`: data parallelism (``parallel.dp``) on real gloo process groups of CPU processes: what
FSDP2 saves per rank, what the refit costs, and a whole trainer step at dp = 1 against dp = 2.

Processes: one spawned process per rank (``parallel.spawn.spawn_ranks``, gloo over TCP on 127.0.0.1),
``--threads`` intra-op threads per rank (default **one**, as ``bench cp``), so dp = 2 uses both cores of a
2-core machine. Every rank of a world runs all the parts in one process: first dp = 1 (one process), then
dp = 2 (two). Parts (``--parts``):

* ``memory``: the policy (``--model``: smollm2 = SmolLM2-135M, tiny = tiny-sft, or a folder; fp32) at
  dp = 1 (a plain module, no wrapping), dp = 2 ``fsdp`` and dp = 2 ``ddp`` (``parallelize_policy``: FSDP2
  ``fully_shard`` per decoder layer + root, or FSDP2 ``replicate``); one forward + backward on a random
  batch of 1 × 64 tokens (loss: the logits' mean), one AdamW step (``update_phase.adamw``, fused, as the
  trainer's), then the bytes the rank holds (``data_parallel.local_bytes``: a DTensor's local shard) of
  parameters, gradients and optimiser state (every state tensor, the step counters included), max over
  ranks; ``*_ratio``: against dp = 1 (fsdp ≈ 0.5, ddp = 1).
* ``refit``: in the same runs, the rollout engine's full copy (``RolloutWeights(policy, float32,
  gather=True)``, made before wrapping, as the trainer does) refreshed from the trainer's weights after the
  update: ``refresh()`` after a barrier, wall time max over ranks, median over ``--repeats`` (after one
  untimed call), then ``check`` (the copy equals the weights). At fsdp every tensor is all-gathered
  (``DTensor.full_tensor``); at ddp the full tensors are local; at dp = 1 it is a plain copy (the trainer
  at dp = 1 has no copy at all: this row is the memcpy floor). ``copy_bytes``: the copy's bytes;
  ``gb_per_s``: copy_bytes / refit_s.
* ``step``: weak scaling of a whole ``Trainer.step`` (rollout, reward, update, refit) on the tiny preset (the
  default ``codraft train`` config; validation, speedup probes and checkpoints off; ``memory_check=false``):
  dp = 1 with ``rollout.prompts_per_step`` = P (``--prompts``) and dp = 2 with 2P, so each rank decodes and
  trains P prompt groups. ``time_*``: the trainer's own metrics (a step's time is its slowest rank's), median
  over ``--steps`` steps after one warm-up step; ``efficiency`` = T(1) / T(2) of ``time_step`` (1 = perfect
  weak scaling), likewise ``train_efficiency``, ``rollout_efficiency``. dp = 2 samples other prompts than
  dp = 1 (2P of them), and a rollout lasts as long as its longest row: ``completion_len`` says how much was
  decoded. On 2 cores this mostly shows the overheads (gathering the rollouts, FSDP's collectives, the
  refit), not a speedup. Extra ``key=value`` overrides apply to both sides (``parallel.dp_shard=ddp``, ...).
* ``stages``: dp = 2 × pp = 2 (four processes) with ``fsdp`` (``sharded_stages.shard_stage``: a stage's
  parameters sharded over its two data ranks, the other stage's freed) and ``ddp`` (every rank holds the whole
  policy, a stage trains its own parameters): one forward + backward of the rank's stage on the memory part's
  batch (the first stage embeds, the last runs the head; a random input elsewhere), the gradient sums
  (``gradients.reduce_stage_gradients``), one AdamW step over the stage's parameters, then the bytes held as in
  ``memory`` (ratios against dp = 1, when it ran); and the weight sync after the update as in ``refit``: at
  ``fsdp`` the engine's whole copy filled stage by stage (``StageRefit``: each stage gathers its shards, its
  first rank broadcasts them), at ``ddp`` each stage's weights broadcast to every rank
  (``gradients.sync_stage_weights``).

Every row carries the CPU's model name (``processor``) and the date (``machine_info``).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from codraft.bench import format_table, machine_info
from codraft.bench.spec import MODELS
from codraft.config import ParallelConfig, RunConfig, load_config
from codraft.parallel.layout import Layout
from codraft.parallel.data_parallel import local_bytes, parallelize_policy
from codraft.parallel.mesh import build_mesh
from codraft.parallel.parallelize import parallelize
from codraft.parallel.pipeline import stage_layers, stage_parameters
from codraft.parallel.spawn import raise_errors, spawn_ranks
from codraft.policy import load_policy
from codraft.parallel.gradients import reduce_stage_gradients, sync_stage_weights
from codraft.parallel.stages import Pipeline
from codraft.rl.trainer import Trainer
from codraft.rl.update_phase import adamw
from codraft.rollout.weights import RolloutWeights

PARTS = ("memory", "refit", "step", "stages")
TOKENS = 64  # the memory part's batch: 1 row of this many random tokens


# ---- one rank -------------------------------------------------------------------------------


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _layout_run(rank: int, world: int, mode: str | None, cfg: dict) -> dict:
    """One layout of the memory / refit parts on this rank: bytes held, refit seconds per repeat."""

    torch.manual_seed(0)
    policy = load_policy(MODELS.get(cfg["model"], cfg["model"]), torch.float32)[0]
    rw = RolloutWeights(policy, torch.float32, gather=True) if "refit" in cfg["parts"] else None
    if mode is not None:
        parallelize_policy(policy, build_mesh(Layout(dp=world, dp_shard=mode), "cpu", cfg["timeout"]), mode)
    opt = adamw(policy.parameters(), lr=1e-5)
    ids = torch.randint(policy.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(rank))
    policy(ids).float().mean().backward()
    opt.step()
    out = held(policy, opt)
    if rw is not None:
        runs = timed(world, rw.refresh, cfg["repeats"])
        rw.check("bench dp refit")
        out.update(refit_runs_s=runs, copy_bytes=sum(t.nbytes for t in rw.policy.state_dict().values()))
    del policy, opt, rw
    return out


def held(policy, opt) -> dict:
    """Bytes this rank holds of the policy's parameters, gradients and ``opt``'s state (every state tensor)."""
    return {"param_bytes": local_bytes(policy.parameters()),
            "grad_bytes": local_bytes(p.grad for p in policy.parameters()),
            "optim_bytes": local_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
            "parameters": sum(p.numel() for p in policy.parameters())}


def timed(world: int, fn, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` on this rank, each after a barrier, after one untimed call."""
    fn()  # untimed: first calls
    runs = []
    for _ in range(repeats):
        _barrier(world)
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return runs


def _stages_run(rank: int, world: int, mode: str, cfg: dict) -> dict:
    """dp = 2 × pp = 2 on this rank: bytes held after one step of its stage, the weight sync's seconds."""
    torch.manual_seed(0)
    policy = load_policy(MODELS.get(cfg["model"], cfg["model"]), torch.float32)[0]
    run = RunConfig(parallel=ParallelConfig(dp=2, pp=2, dp_shard=mode, timeout=cfg["timeout"]))
    layout = Layout.of(run.parallel)
    mesh = build_mesh(layout, "cpu", cfg["timeout"])
    rw = RolloutWeights(policy, torch.float32, gather=True) if layout.gathers else None
    parallelize(policy, None, mesh, run, rw, trains_draft=False)  # as the trainer does (ddp: no sharding)
    opt = adamw(stage_parameters(policy, mesh.stage, mesh.pp), lr=1e-5)
    layers = stage_layers(policy.config.num_hidden_layers, mesh.pp)[mesh.stage]
    ids = torch.randint(policy.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(rank))
    x = policy.embed(ids) if mesh.first else torch.randn(1, TOKENS, policy.config.hidden_size)
    out, _ = policy.run_layers(x, policy.layer_inputs(1, TOKENS, "cpu"), layers)
    (policy.logits(out) if mesh.last else out).float().mean().backward()
    pipe = Pipeline(mesh, layers, "shm", link=None)
    reduce_stage_gradients(pipe, policy, [])  # (ddp: the stage's data ranks' sum; both: the tied weight's two shares)
    opt.step()
    out = held(policy, opt)
    if rw is not None:
        runs, copy = timed(world, rw.refresh, cfg["repeats"]), rw.policy
        rw.check("bench dp stages refit")
    else:
        runs, copy = timed(world, lambda: sync_stage_weights(pipe, policy, []), cfg["repeats"]), policy
    out.update(refit_runs_s=runs, copy_bytes=sum(t.nbytes for t in copy.state_dict().values()))
    return out


def trainer_steps(rank: int, cfg: dict, label: str, overrides: list[str]) -> tuple:
    """``cfg["steps"]`` + 1 steps of the tiny preset (validation, speedup probes, checkpoints off) with
    ``overrides`` then ``cfg["overrides"]``: the run's config and each step's ``time_*`` metrics and
    completion_len after the warm-up step."""
    overrides = [f"steps={cfg['steps'] + 1}", f"run_dir={os.path.join(cfg['tmp'], label.replace('=', ''))}",
                 "log.val_every=0", "log.speedup_every=0", "log.checkpoint_every=0", "memory_check=false",
                 f"parallel.timeout={cfg['timeout']}", *overrides, *cfg["overrides"]]
    tr = Trainer(load_config(None, overrides), progress=False)
    rows = []
    for step in range(cfg["steps"] + 1):  # step 0: warm-up (first calls, lazy set-up)
        m = tr.step(step)
        rows.append({k: float(v) for k, v in m.items() if k.startswith("time_") or k == "completion_len"})
        if rank == 0 and cfg["verbose"]:
            print(f"  {label} step {step}: {m['time_step']:.2f} s", flush=True)
    tr._unlock()
    return tr.cfg, rows[1:]


def step_summary(rows: list[dict], base: list[dict] | None, ratio: str) -> dict:
    """``trainer_steps``' rows -> the medians of the step's times and completion length, each step's time, and
    T(base) / T of time_step, time_train and time_rollout against the one-rank run's rows ``base`` (named
    ``ratio``, ``train_<ratio>``, ``rollout_<ratio>``; None without a base)."""
    def medians(rs):
        return {k: statistics.median(r[k] for r in rs) for k in rs[0]} if rs else {}
    m, one = medians(rows), medians(base)
    against = lambda k: one[k] / m[k] if k in one and m.get(k) else None
    return {"steps": len(rows), "time_step": m["time_step"], "time_rollout": m.get("time_rollout"),
            "time_train": m.get("time_train"), "time_refit": m.get("time_refit"),
            "completion_len": m.get("completion_len"), "time_step_runs": [r["time_step"] for r in rows],
            ratio: against("time_step"), f"train_{ratio}": against("time_train"),
            f"rollout_{ratio}": against("time_rollout")}


def _step_run(rank: int, world: int, cfg: dict) -> dict | None:
    """The weak-scaling part on this rank: rank 0's metrics rows (the slowest rank's times), None elsewhere."""

    prompts = cfg["prompts"] * world
    run_cfg, rows = trainer_steps(rank, cfg, f"dp={world}", [f"parallel.dp={world}",
                                                             f"rollout.prompts_per_step={prompts}"])
    shard = run_cfg.parallel.dp_shard if world > 1 else None
    return {"rows": rows, "prompts_per_step": prompts, "shard": shard} if rank == 0 else None


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    # FSDP2 warns that the logits are a view (an in-place op on them would skip its hook): none is made
    warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
    out = {"layouts": {}, "step": None}
    if world == 4:  # the stages part only
        for mode in ("fsdp", "ddp"):
            out["layouts"][mode] = _stages_run(rank, world, mode, cfg)
            _barrier(world)
        return out
    if {"memory", "refit"} & set(cfg["parts"]):
        modes = [None] if world == 1 else (["fsdp", "ddp"] if "memory" in cfg["parts"] else ["fsdp"])
        for mode in modes:
            out["layouts"][mode] = _layout_run(rank, world, mode, cfg)
            _barrier(world)
    if "step" in cfg["parts"]:
        out["step"] = _step_run(rank, world, cfg)
    return out


# ---- aggregation ----------------------------------------------------------------------------


def _label(world: int, shard: str | None) -> str:
    return "dp=1" if world == 1 else f"dp=2 pp=2 {shard}" if world == 4 else f"dp={world} {shard}"


def _rows(per_world: dict[int, list[dict]], parts, model: str) -> list[dict]:
    rows = []
    base = per_world[1][0]["layouts"].get(None) if 1 in per_world else None
    for world, ranks in per_world.items():
        for mode, first in ranks[0]["layouts"].items():
            recs = [r["layouts"][mode] for r in ranks]
            pp = 2 if world == 4 else 1
            common = {"layout": _label(world, mode), "dp": world // pp, "pp": pp, "shard": mode, "model": model}
            if "memory" in parts or pp > 1:
                row = {"part": "memory", **common, "parameters": first["parameters"]}
                for k in ("param", "grad", "optim"):
                    row[f"{k}_bytes"] = max(r[f"{k}_bytes"] for r in recs)
                    row[f"rank_{k}_bytes"] = [r[f"{k}_bytes"] for r in recs]
                row["total_bytes"] = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in recs)
                for k in ("param", "grad", "optim", "total"):
                    b = None if base is None else (base[f"{k}_bytes"] if k != "total" else
                                                   base["param_bytes"] + base["grad_bytes"] + base["optim_bytes"])
                    row[f"{k}_ratio"] = row[f"{k}_bytes"] / b if b else None
                rows.append(row)
            if "refit" in parts or pp > 1:
                runs = [max(r["refit_runs_s"][i] for r in recs) for i in range(len(first["refit_runs_s"]))]
                med = statistics.median(runs)
                rows.append({"part": "refit", **common, "refit_s": med, "refit_runs_s": runs,
                             "copy_bytes": first["copy_bytes"], "gb_per_s": first["copy_bytes"] / med / 1e9})
    steps = {w: ranks[0]["step"] for w, ranks in per_world.items() if ranks[0]["step"] is not None}
    for w, s in steps.items():
        rows.append({"part": "step", "layout": _label(w, s["shard"]), "dp": w, "shard": s["shard"],
                     "prompts_per_step": s["prompts_per_step"],
                     **step_summary(s["rows"], steps[1]["rows"] if 1 in steps else None, "efficiency")})
    return rows


def _tables(rows: list[dict]) -> str:
    mb = lambda b: None if b is None else b / 2 ** 20
    out = []
    mem = [r for r in rows if r["part"] == "memory"]
    if mem:
        out.append("per-rank bytes after one step (max over ranks), MiB:\n" + format_table(
            [[r["layout"], mb(r["param_bytes"]), mb(r["grad_bytes"]), mb(r["optim_bytes"]), mb(r["total_bytes"]),
              r["param_ratio"], r["grad_ratio"], r["optim_ratio"], r["total_ratio"]] for r in mem],
            ["layout", "params", "grads", "AdamW", "total", "params/dp1", "grads/dp1", "AdamW/dp1", "total/dp1"]))
    refit = [r for r in rows if r["part"] == "refit"]
    if refit:
        out.append("refit (RolloutWeights.refresh, max over ranks, median):\n" + format_table(
            [[r["layout"], r["refit_s"] * 1e3, mb(r["copy_bytes"]), r["gb_per_s"]] for r in refit],
            ["layout", "ms", "copy MiB", "GB/s"]))
    step = [r for r in rows if r["part"] == "step"]
    if step:
        out.append(step_table(step, "trainer step, weak scaling (P prompts per rank), s", "efficiency",
                              ["eff T1/T2", "train eff", "rollout eff"]))
    return "\n\n".join(out)


def step_table(rows: list[dict], title: str, ratio: str, names: list[str]) -> str:
    """``step_summary`` rows as a table, the three ratios under ``names``."""
    return f"{title}:\n" + format_table(
        [[r["layout"], r["prompts_per_step"], r["time_step"], r["time_rollout"], r["time_train"], r["time_refit"],
          r["completion_len"], r[ratio], r[f"train_{ratio}"], r[f"rollout_{ratio}"]] for r in rows],
        ["layout", "prompts", "step", "rollout", "train", "refit", "compl len", *names])


def run(model_name: str = "smollm2", parts=PARTS, repeats: int = 5, steps: int = 3, prompts: int = 8,
        threads: int = 1, overrides=(), json_path: str | None = None, timeout: float = 600.0,
        verbose: bool = True) -> list[dict]:
    bad = sorted(set(parts) - set(PARTS))
    if bad or not parts:
        raise ValueError(f"--parts: {', '.join(bad) or 'none given'}; choose from {', '.join(PARTS)}")
    if repeats < 1 or steps < 1 or prompts < 1 or threads < 1:
        raise ValueError("--repeats, --steps, --prompts and --threads must be >= 1")
    info = machine_info(kernels=False)
    info.update(threads_per_rank=threads, backend="gloo")
    print(f"bench dp: {info['processor']}, {info['cpu_count']} CPUs, torch {info['torch']}; {threads} intra-op "
          f"thread(s) per rank; parts {', '.join(parts)}; model {model_name}", flush=True)
    tmp = tempfile.mkdtemp(prefix="codraft-bench-dp-")
    cfg = {"model": model_name, "parts": list(parts), "repeats": repeats, "steps": steps, "prompts": prompts,
           "threads": threads, "overrides": list(overrides), "timeout": timeout, "tmp": tmp, "verbose": verbose}
    t0, per_world = time.perf_counter(), {}
    try:
        worlds = [w for w, part in ((1, {"memory", "refit", "step"}), (2, {"memory", "refit", "step"}),
                                    (4, {"stages"})) if part & set(parts)]
        for world in worlds:
            results, errors = spawn_ranks(_rank_main, world, cfg, timeout=timeout * 6, pg_timeout=timeout)
            raise_errors(errors, f"bench dp ({_label(world, 'fsdp and ddp') if world > 1 else 'dp=1'})")
            per_world[world] = [results[r] for r in range(world)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = _rows(per_world, parts, model_name)
    for r in rows:
        r.update(processor=info["processor"], date=info["date"], torch=info["torch"], threads_per_rank=threads)
    print(_tables(rows))
    if "step" in parts:
        print("(eff T1/T2: 1 = perfect weak scaling; on 2 cores it mostly shows the overheads of dp = 2)")
    if json_path:
        settings = {k: v for k, v in cfg.items() if k not in ("tmp", "verbose")} | {"tokens": TOKENS}
        payload = {"bench": "dp", "machine": info, "settings": settings, "wall_s": time.perf_counter() - t0,
                   "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {json_path}")
    return rows
