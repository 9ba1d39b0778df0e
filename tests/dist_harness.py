"""Real gloo process groups for distributed tests: ``run_ranks(fn, world, *args)`` spawns
``world`` processes, each joining a fresh gloo group and calling ``fn(rank, world, *args)``;
returns every rank's result in rank order. A rank that raises fails the test with its
traceback; ranks that do not finish within ``timeout`` are killed and fail it (never a hang).
``fn`` must be a module-level function of an importable module (spawn pickles it by name).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, out, pg_timeout):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        out.put((rank, True, result))
    except BaseException:  # reported to the parent, which fails the test
        out.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0, expect_failure: bool = False):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, out, pg_timeout), daemon=True)
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
                if expect_failure and not any(p.is_alive() for p in procs):
                    break  # a rank that died reports nothing
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(results) - set(errors))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout} s") from None
                continue
            (results if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if expect_failure:  # (results, errors) by rank, for tests of failures
        return results, errors
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world)]
