"""Real gloo process groups for distributed tests: ``run_ranks(fn, world, *args)`` spawns
``world`` processes (``codraft.parallel.spawn``), each joining a fresh gloo group and calling
``fn(rank, world, *args)``; returns every rank's result in rank order. A rank that raises fails the
test with its traceback; ranks that do not finish within ``timeout`` are killed and fail it (never
a hang). ``expect_failure``: return ``(results, errors)`` by rank instead, a rank that died
reporting nothing. ``fn`` must be a module-level function of an importable module.
"""
from __future__ import annotations

from codraft.parallel.spawn import spawn_ranks


def run_ranks(fn, world: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0, expect_failure: bool = False):
    results, errors = spawn_ranks(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, allow_dead=expect_failure)
    if expect_failure:
        return results, errors
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world)]
