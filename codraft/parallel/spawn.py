"""Local gloo groups in spawned processes, for benchmarks and tests of distributed code.

``spawn_ranks(fn, world, *args)`` starts ``world`` processes, each joining a fresh gloo group on
127.0.0.1 (one intra-op thread) and calling ``fn(rank, world, *args)``; it returns
``(results, errors)``, both by rank, ``errors`` holding a failing rank's traceback. Ranks that do
not finish within ``timeout`` are killed and raise ``RuntimeError`` naming them (never a hang);
with ``allow_dead`` a rank that died without reporting is simply absent from both (for tests of
dead peers). ``fn`` (and ``setup``, run first in each process) must be module-level functions of
importable modules: spawn (``start_method``) pickles them by name.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method() -> str:
    """fork where it is safe: a rank forked from the caller has torch and codraft loaded already (spawn
    imports them again in every rank, ~3 s of CPU each on a 2-core host, most of a small distributed test).
    spawn once CUDA is initialised in the caller (a forked child cannot use it), once the caller has a default
    process group (vLLM's in-process engine makes one; a forked child would inherit it and could not make its
    own), or where there is no fork."""
    if "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized() and not dist.is_initialized():
        return "fork"
    return "spawn"


def _worker(fn, setup, rank, world, port, args, out, pg_timeout):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if setup is not None:
        setup()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        # as bytes: a tensor put on the queue as is travels as a shared-memory handle, which the
        # parent cannot open once this process has exited ("connection reset by peer")
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        out.put((rank, True, buf.getvalue()))
    except BaseException:  # reported to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn, world: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0, setup=None,
                allow_dead: bool = False) -> tuple[dict, dict]:
    ctx = mp.get_context(start_method())
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, setup, r, world, port, args, out, pg_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, ok, value = out.get(timeout=0.5)
            except queue.Empty:
                if allow_dead and not any(p.is_alive() for p in procs):
                    break  # a rank that died reports nothing
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(results) - set(errors))
                    raise RuntimeError(f"ranks {missing} of {world} did not finish within {timeout} s") from None
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results, errors


def raise_errors(errors: dict, what: str) -> None:
    """One RuntimeError carrying every failing rank's traceback."""
    if errors:
        ranks = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{what} failed:\n{ranks}")
