"""`codraft bench tp`: tensor parallelism (``parallel.tp``) on real gloo process groups of CPU processes: what
splitting the policy's products saves per rank, what its forward + backward costs, and a whole trainer step at
tp = 1 against tp = T.

Processes: one spawned process per rank (``parallel.spawn.spawn_ranks``, gloo over TCP on 127.0.0.1),
``--threads`` intra-op threads per rank (default one, as ``bench dp``). Worlds run one after the other: tp = 1
(one process), tp = T (``--tp``, default 2; T processes; the memory part also with sequence parallelism),
dp = 2 × tp = T (2T processes, memory part only).
Parts (``--parts``):

* ``memory``: the policy (``--model``: tiny = tiny-sft, smollm2 = SmolLM2-135M, or a folder; fp32) at tp = 1 (a
  plain module), tp = T (``tp.parallelize_tp`` over the mesh's tp dimension) and dp = 2 × tp = T with ``fsdp``
  (the tp plans, then FSDP2 over dp: what ``parallel.parallelize`` applies). A forward + backward on a random
  packed row of ``--tokens`` tokens in ``SEQUENCES`` sequences (the loss: the next tokens' mean logprob, from
  the vocabulary-split logits at tp > 1, as the GRPO loss reads them), ``clip_grad_norm``, one AdamW step
  (``update_phase.adamw``), then the bytes the rank holds of parameters, gradients and optimiser state
  (``data_parallel.local_bytes``), max over ranks; ``*_ratio``: against tp = 1 (≈ 1/T at tp = T, a little more:
  the norms are replicated; ≈ 1/(2T) at dp = 2). ``act_bytes``: the activations the forward keeps for the
  backward (autograd's saved tensors, each storage once, this rank's shard of a DTensor, the parameters' own
  excluded; under FSDP the gathered weights it saves count too), also at tp = T with sequence parallelism
  (``tp=T sp``: the residual stream and the norms split along the sequence too). ``fwd_bwd_s``: the forward +
  backward's wall time, max over ranks, median over ``--repeats`` after one untimed call; ``fwd_bwd_ratio``:
  against tp = 1. ``grad_norm``: before clipping (tp = T sees tp = 1's batch, so the same norm; the dp ranks' batches differ and add up).
* ``step``: strong scaling of a whole ``Trainer.step`` on the tiny preset (``bench dp``'s ``trainer_steps``):
  tp = 1 and tp = T with the same ``rollout.prompts_per_step`` (``--prompts``); every rank decodes its share
  of the rollouts and trains the whole batch on its share of the products. ``time_*``: the trainer's metrics,
  median over ``--steps`` after one warm-up step; ``speedup`` = T(1) / T(T) of ``time_step`` (likewise
  ``train_speedup``, ``rollout_speedup``). Extra ``key=value`` overrides apply to both sides.

Every row carries the CPU's model name, its flags and the date (``machine_info``).
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from codraft.bench import format_table, machine_info, write_json
from codraft.bench.dp import held, step_summary, step_table, timed, trainer_steps
from codraft.bench.spec import MODELS
from codraft.config import load_config
from codraft.parallel import tp as tensor_parallel
from codraft.models.layers import whole
from codraft.parallel.data_parallel import parallelize_policy
from codraft.parallel.gradients import clip_grad_norm
from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel.spawn import raise_errors, spawn_ranks
from codraft.policy import load_policy
from codraft.policy.resolve import policy_config
from codraft.rl.grpo import token_logprobs
from codraft.rl.update_phase import adamw

PARTS = ("memory", "step")
SEQUENCES = 4  # the memory part's packed row: this many sequences of equal length


# ---- one rank -------------------------------------------------------------------------------


def _degrees(world: int, tp: int) -> tuple[int, int]:
    """(dp, tp) of a world: 1 process, tp processes, or dp = 2 × tp."""
    return (1, 1) if world == 1 else (world // tp, tp)


def _batch(vocab: int, tokens: int, seed: int):
    """A random packed row: ids (1, N), cu_seqlens, the rows whose next token is in their sequence, those ids."""
    ids = torch.randint(vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    cu = torch.linspace(0, tokens, SEQUENCES + 1).long()
    keep = torch.ones(tokens, dtype=torch.bool)
    keep[cu[1:] - 1] = False  # a sequence's last token predicts nothing
    rows = keep.nonzero()[:, 0]
    return ids, cu.int(), rows, ids[0, rows + 1]


def _memory_run(world: int, cfg: dict, mesh, sequence: bool = False) -> dict:
    """One layout of the memory part on this rank (``sequence``: with sequence parallelism): bytes held after
    the step, the activations the forward saves for the backward, forward + backward seconds."""
    torch.manual_seed(0)
    policy = load_policy(MODELS.get(cfg["model"], cfg["model"]), torch.float32)[0]
    if mesh is not None:
        tensor_parallel.parallelize_tp(policy, mesh.tp_mesh, sequence)  # first: FSDP then shards the pieces
        if mesh.dp > 1:
            parallelize_policy(policy, mesh, "fsdp")
    params = list(policy.parameters())
    opt = adamw(params, lr=1e-5)
    ids, cu, rows, targets = _batch(policy.config.vocab_size, cfg["tokens"],
                                    0 if mesh is None else mesh.dp_rank)  # (tp ranks: one batch)

    def loss():
        hidden = whole(policy(ids, cu_seqlens=cu, head=False))  # (sequence parallelism: gathered, as Row.forward)
        logits = policy.logits(hidden[0, rows])  # (tp: split on the vocabulary)
        logp = tensor_parallel.token_logprobs(logits, targets) if isinstance(logits, DTensor) else \
            token_logprobs(logits, targets)
        return -logp.mean()

    def forward_backward():
        policy.zero_grad(set_to_none=True)
        loss().backward()

    with SavedForBackward(params) as saved:
        out = loss()
    out.backward()
    runs = timed(world, forward_backward, cfg["repeats"])
    norm = clip_grad_norm(params, 1.0)
    opt.step()
    return held(policy, opt) | {"act_bytes": saved.bytes, "fwd_bwd_runs_s": runs, "grad_norm": float(norm)}


class SavedForBackward:
    """``with SavedForBackward(params) as s: loss = ...`` -> ``s.bytes``: the storage the forward keeps for the
    backward (autograd's saved tensors: this rank's shard of a DTensor), each storage once, the parameters'
    excluded (counted as parameters)."""

    def __init__(self, params):
        self.seen = {st.data_ptr() for p in params for st in _storages(p)}
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for storage in _storages(t):
            if storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _storages(t: torch.Tensor):
    """The storages under ``t``: a wrapper's (a DTensor's local shard, a collective's pending result) or its own."""
    if is_traceable_wrapper_subclass(t):
        for inner in (getattr(t, name) for name in t.__tensor_flatten__()[0]):
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    else:
        yield t.untyped_storage()


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    # FSDP2 warns that the hidden states are a view (an in-place op on them would skip its hook): none is made
    warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
    out = {"memory": None, "memory_sp": None, "step": None}
    if "memory" in cfg["parts"]:
        dp, tp = _degrees(world, cfg["tp"])
        mesh = build_mesh(Layout(dp=dp, tp=tp, dp_shard="fsdp"), "cpu", cfg["timeout"]) if world > 1 else None
        out["memory"] = _memory_run(world, cfg, mesh)
        if world == cfg["tp"]:  # tp = T with sequence parallelism too
            out["memory_sp"] = _memory_run(world, cfg, mesh, sequence=True)
        if world > 1:
            dist.barrier()
    if "step" in cfg["parts"] and world <= cfg["tp"]:
        _, rows = trainer_steps(rank, cfg, f"tp={world}", [f"parallel.tp={world}",
                                                           f"rollout.prompts_per_step={cfg['prompts']}"])
        out["step"] = rows if rank == 0 else None
    return out


# ---- aggregation ----------------------------------------------------------------------------


def _label(dp: int, tp: int, sequence: bool = False) -> str:
    return (f"tp={tp}" if dp == 1 else f"dp={dp} tp={tp} fsdp") + (" sp" if sequence else "")


def _memory_rows(per_world: dict[int, list[dict]], cfg: dict) -> list[dict]:
    rows = []
    for (world, ranks), part in ((w, p) for w in per_world.items() for p in ("memory", "memory_sp")):
        recs = [r[part] for r in ranks]
        if recs[0] is None:
            continue
        dp, tp = _degrees(world, cfg["tp"])
        sp = part == "memory_sp"
        row = {"part": "memory", "layout": _label(dp, tp, sp), "dp": dp, "tp": tp, "sequence_parallel": sp,
               "shard": "fsdp" if dp > 1 else None, "model": cfg["model"], "tokens": cfg["tokens"],
               "parameters": recs[0]["parameters"]}
        for k in ("param", "grad", "optim", "act"):
            row[f"{k}_bytes"] = max(r[f"{k}_bytes"] for r in recs)
            row[f"rank_{k}_bytes"] = [r[f"{k}_bytes"] for r in recs]
        row["total_bytes"] = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in recs)
        runs = [max(r["fwd_bwd_runs_s"][i] for r in recs) for i in range(len(recs[0]["fwd_bwd_runs_s"]))]
        row.update(fwd_bwd_s=statistics.median(runs), fwd_bwd_runs_s=runs, grad_norm=recs[0]["grad_norm"])
        rows.append(row)
    base = next((r for r in rows if r["tp"] == 1), None)
    for r in rows:
        for k, of in (("param", "param_bytes"), ("grad", "grad_bytes"), ("optim", "optim_bytes"),
                      ("total", "total_bytes"), ("act", "act_bytes"), ("fwd_bwd", "fwd_bwd_s")):
            r[f"{k}_ratio"] = r[of] / base[of] if base and base[of] else None
    return rows


def _step_rows(per_world: dict[int, list[dict]], cfg: dict) -> list[dict]:
    steps = {w: ranks[0]["step"] for w, ranks in per_world.items() if ranks[0]["step"]}
    return [{"part": "step", "layout": f"tp={w}", "tp": w, "prompts_per_step": cfg["prompts"],
             **step_summary(s, steps.get(1), "speedup")} for w, s in steps.items()]


def _tables(rows: list[dict]) -> str:
    mb = lambda b: b / 2 ** 20
    out = []
    mem = [r for r in rows if r["part"] == "memory"]
    if mem:
        out.append("per-rank bytes after one step (max over ranks), MiB; forward + backward (max over ranks, "
                   "median), ms:\n" + format_table(
                       [[r["layout"], mb(r["param_bytes"]), mb(r["grad_bytes"]), mb(r["optim_bytes"]),
                         mb(r["total_bytes"]), r["param_ratio"], r["grad_ratio"], r["optim_ratio"], r["total_ratio"],
                         mb(r["act_bytes"]), r["act_ratio"], r["fwd_bwd_s"] * 1e3, r["fwd_bwd_ratio"]] for r in mem],
                       ["layout", "params", "grads", "AdamW", "total", "params/tp1", "grads/tp1", "AdamW/tp1",
                        "total/tp1", "activations", "act/tp1", "fwd+bwd ms", "time/tp1"]))
    step = [r for r in rows if r["part"] == "step"]
    if step:
        out.append(step_table(step, "trainer step, strong scaling (the same prompts per step), s", "speedup",
                              ["T1/T", "train T1/T", "rollout T1/T"]))
    return "\n\n".join(out)


def _refuse(parts, tp: int, model: str, overrides) -> None:
    """One line before any process starts: a policy whose heads or MLP do not split over ``tp``."""
    inits = {"--model " + model: MODELS.get(model, model)} if "memory" in parts else {}
    if "step" in parts:
        inits["the step part's policy"] = load_config(None, list(overrides)).policy.init
    for what, init in inits.items():
        why = tensor_parallel.check(policy_config(init)[0], tp)
        if why:
            raise ValueError(f"{what} ({init}) does not split over --tp {tp}: {why}")


def run(model_name: str = "tiny", parts=PARTS, tp: int = 2, tokens: int = 256, repeats: int = 3, steps: int = 3,
        prompts: int = 8, threads: int = 1, overrides=(), json_path: str | None = None, timeout: float = 600.0,
        verbose: bool = True) -> list[dict]:
    bad = sorted(set(parts) - set(PARTS))
    if bad or not parts:
        raise ValueError(f"--parts: {', '.join(bad) or 'none given'}; choose from {', '.join(PARTS)}")
    if repeats < 1 or steps < 1 or prompts < 1 or threads < 1 or tp < 2 or tokens < 2 * SEQUENCES:
        raise ValueError(f"--repeats, --steps, --prompts and --threads must be >= 1, --tp >= 2, "
                         f"--tokens >= {2 * SEQUENCES}")
    _refuse(parts, tp, model_name, overrides)
    info = machine_info(kernels=False)
    info.update(threads_per_rank=threads, backend="gloo")
    print(f"bench tp: {info['processor']}, {info['cpu_count']} CPUs, torch {info['torch']}; {threads} intra-op "
          f"thread(s) per rank; parts {', '.join(parts)}; model {model_name}; tp {tp}", flush=True)
    tmp = tempfile.mkdtemp(prefix="codraft-bench-tp-")
    cfg = {"model": model_name, "parts": list(parts), "tp": tp, "tokens": tokens, "repeats": repeats,
           "steps": steps, "prompts": prompts, "threads": threads, "overrides": list(overrides), "timeout": timeout,
           "tmp": tmp, "verbose": verbose}
    t0, per_world = time.perf_counter(), {}
    try:
        for world in [1, tp] + ([2 * tp] if "memory" in parts else []):
            results, errors = spawn_ranks(_rank_main, world, cfg, timeout=timeout * 6, pg_timeout=timeout)
            raise_errors(errors, f"bench tp ({_label(*_degrees(world, tp))})")
            per_world[world] = [results[r] for r in range(world)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = _memory_rows(per_world, cfg) + _step_rows(per_world, cfg)
    for r in rows:
        r.update(processor=info["processor"], cpu_flags=info["cpu_flags"], date=info["date"], torch=info["torch"],
                 threads_per_rank=threads)
    print(_tables(rows))
    print(f"(on {info['cpu_count']} cores with {threads} thread(s) per rank, the times mostly show tp's overheads)")
    if json_path:
        settings = {k: v for k, v in cfg.items() if k not in ("tmp", "verbose")} | {"sequences": SEQUENCES}
        write_json({"bench": "tp", "machine": info, "settings": settings, "wall_s": time.perf_counter() - t0,
                    "rows": rows}, json_path)
    return rows
