"""Which implementation of a CPU decode operation is fastest here, per row count: timed on this
machine the first time an operation of a given shape runs, then cached on disk.

Decoding multiplies every weight by 1..B·(γ+1) rows, and which implementation streams it fastest
(the C kernel, MKL's ``x @ wᵀ``, the same as ``(w @ xᵀ)ᵀ``; one C call per decoder layer or one per
norm, attention and product) depends on the CPU, the thread count, the weight dtype, the shape
and the row count: the C GEMV kernel won up to 16 rows on one 2-core AMD EPYC and lost at 1 row
on one 2-core Intel Xeon. So no threshold is written down: ``lookup(op, key, *args)`` returns the
``Table`` of ``op`` (an ``Operation``: its candidate paths and how to build them) for ``key`` (its
shapes and dtype) on this machine, measured on a miss:

* **Timing** (``measure``): rounds that sweep the grid (``GRID``), one call per candidate at each
  row count, in an order that rotates each round (a slow moment hits every candidate alike, and
  a row count's samples spread over the whole measurement); the best of 7 rounds where a round
  takes under 10 ms, of 3 under 100 ms, else of 2 (``ROUNDS``); after two rounds of 10 ms or more a
  candidate whose best is 2× the best gets no more rounds at that row count (it cannot win). Each
  call works on another of ``copies`` copies of the operands, so they stream from memory as in a
  decode step, not from a warm cache.
* **Ranges** (``ranges``): a row count between two grid points takes the choice of the nearer one
  (the lower on a tie); above ``GRID[-1]`` (and at 0 rows) the fastest at ``GRID[-1]`` if it is one
  of the operation's paths that ``scales`` (whose speed there carries over to prefills), else its
  ``beyond`` path.
* **Cache**: JSON under ``cache_root()/dispatch``, one file per operation and key, named by a
  hash of the key together with this machine's: CPU model and flags (what ``-march=native`` sees),
  torch's thread count, torch's version, the built kernel library (``CODRAFT_KERNELS=0``: "off",
  and no kernel candidates) and the GEMV kernel's tuning: how it prefetches and from how many rows it
  pairs weight rows (``gemv.tuning``).
  A file recorded for another key, or unreadable, is measured again (warned); files are replaced
  atomically, so concurrent processes (``pytest -n``) are safe.
  This process keeps the tables it has read in ``TABLES``: a lookup is one dict access.
* **A busy machine**: while other processes hold the cores torch's threads need, every parallel
  call can wait a scheduler slice (ms) and the timings say nothing. So the CPU time others used
  during a measurement is read from ``/proc``; if they left fewer cores than the threads (half a
  core of slack), the table is used by this process only (warned) and measured again next time.
  A table that still picks badly: ``codraft bench gemv --remeasure`` (``forget``) measures again
  and shows the tables.

Known limits (docs/bench-spec.md): MKL's speed is jagged in the row count, so a count between
grid points can lose to the point whose choice it takes; and a product is timed on its own, not
inside the model's stream of other weights. Not here: the candidates (``codraft.kernels.products``
for products, ``codraft.kernels.fast_layers`` for decoder layers).
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Callable

import torch

from codraft.atomic import atomic_write_text
from codraft.cache import cache_root
from codraft.kernels import cbuild, gemv

FORMAT = 7  # bump when what is timed or the file layout changes: older files are measured again
# every row count a decode or verify step of up to 64 rows has (MKL changes code at multiples of 8 and
# 16, so a count between two grid points could lose to its neighbour's choice), then coarser
GRID = (*range(1, 65), 80, 96, 112, 128)
ROUNDS = (7, 3, 2)  # samples per candidate and row count when a round takes < 10 ms, < 100 ms, longer
MAX_COPIES = 256  # operands cycled through while timing (bounds the cost for small shapes)
MAX_COLD_BYTES = 256 << 20  # and their total (bounds the cost on CPUs with a huge last-level cache)

Run = Callable[[], object]  # one call of a candidate at a given row count
At = Callable[[int], "Run | None"]  # rows -> a Run, or None where the candidate does not apply
Timer = Callable[[str, int, Run], float]  # (candidate, rows, run) -> seconds


@dataclass(frozen=True)
class Operation:
    """A decode operation with interchangeable implementations: ``paths`` names them, ``beyond`` is
    the one used above the grid unless the fastest at its top is one that ``scales``;
    ``candidates(*args)`` builds ``{name: At}`` to time them."""
    name: str
    paths: tuple[str, ...]
    beyond: str
    candidates: Callable[..., dict[str, At]]
    scales: tuple[str, ...] = ()


@dataclass(frozen=True)
class Table:
    """The measured choice: ``ranges`` [(first row, last row, path)] cover 1..GRID[-1];
    ``by_rows[m]`` is the path for m rows, for m < len(by_rows) (index 0: above the grid);
    ``times`` {rows: {path: best seconds}} at the grid points; ``busy``: cores other processes
    used while it was measured, when that made it untrustworthy (else 0)."""
    ranges: tuple[tuple[int, int, str], ...]
    by_rows: tuple[str, ...]
    times: dict[int, dict[str, float]]
    busy: float = 0.0

    def path(self, rows: int) -> str:
        """The path for ``rows`` rows: its measured range, or above the grid ``by_rows[0]``."""
        return self.by_rows[rows if rows < len(self.by_rows) else 0]


TABLES: dict[tuple, Table] = {}
_forced: dict[str, Table] = {}  # operation name -> one path at every row count (``forcing``)


def lookup(op: Operation, key: tuple, *args) -> Table:
    """The table of ``op`` for ``key`` (ints and dtypes) here: from this process, else the disk cache,
    else measured with ``op.candidates(*args)`` (a line on stderr) and cached."""
    if _forced and op.name in _forced:
        return _forced[op.name]
    memo = (op.name, key, torch.get_num_threads(), cbuild.library())
    table = TABLES.get(memo)
    if table is None:
        table = TABLES[memo] = _load_or_measure(op, key, args)
    return table


@contextlib.contextmanager
def forcing(paths: dict[str, str]):
    """Within it, every lookup of the operations named (``Operation.name`` -> path) gives that one path
    at every row count, whatever was measured: a benchmark's single-path sides (the caller checks
    that the path applies where it runs)."""
    saved = dict(_forced)
    _forced.update({name: Table((), (path,), {}) for name, path in paths.items()})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def forget() -> None:
    """Drop every table, this process's and the disk cache's: the next lookups measure again."""
    TABLES.clear()
    shutil.rmtree(cache_root() / "dispatch", ignore_errors=True)


def measure(candidates: dict[str, At], grid: tuple[int, ...] = GRID, timer: Timer | None = None
            ) -> dict[int, dict[str, float]]:
    """{rows: {candidate: best seconds}} at each row count of ``grid``, over the candidates that apply
    there (see the module docstring). ``timer`` (default: the wall clock around one call) is
    where a test injects its own times."""
    timer = timer or _wall
    runs = {m: {name: run for name, at in candidates.items() if (run := at(m)) is not None} for m in grid}
    if not all(runs.values()):
        raise ValueError(f"no candidate applies at {[m for m, r in runs.items() if not r]} rows")
    for name, run in runs[grid[0]].items():  # first calls (allocator, MKL's set-up): not counted
        timer(name, grid[0], run)
    best = {m: dict.fromkeys(r, math.inf) for m, r in runs.items()}
    live = {m: list(r) for m, r in runs.items()}
    wanted = dict.fromkeys(grid, 1)
    for round_ in range(max(ROUNDS)):
        for m in grid:  # each round sweeps the grid: a row count's samples spread over the measurement
            if round_ >= wanted[m]:
                continue
            spent = 0.0
            for i in range(len(live[m])):
                name = live[m][(i + round_) % len(live[m])]  # rotating: no candidate always goes first
                t = timer(name, m, runs[m][name])
                best[m][name], spent = min(best[m][name], t), spent + t
            if round_ == 0:  # long calls vary less, and cost more
                wanted[m] = ROUNDS[0] if spent < 0.01 else ROUNDS[1] if spent < 0.1 else ROUNDS[2]
            # a ms call 2× the best cannot win (a µs call may have met an interrupt); not on one sample:
            # a single slow call (page faults, a preemption) made the whole fused stack lose at 1 row
            if spent >= 0.01 and round_ >= 1:
                live[m] = [n for n in live[m] if best[m][n] <= 2 * min(best[m].values())]
    return best


def ranges(times: dict[int, dict[str, float]]) -> tuple[tuple[int, int, str], ...]:
    """[(first row, last row, fastest)] over 1..max(times): a row count between two grid points takes
    the fastest at the nearer one, the lower on a tie."""
    grid = sorted(times)
    fastest = [min(times[m], key=times[m].get) for m in grid]
    out: list[list] = []
    for rows in range(1, grid[-1] + 1):
        i = bisect.bisect_left(grid, rows)  # grid[i] >= rows
        if grid[i] != rows and i > 0 and rows - grid[i - 1] <= grid[i] - rows:
            i -= 1
        pick = fastest[i]
        if out and out[-1][2] == pick:
            out[-1][1] = rows
        else:
            out.append([rows, rows, pick])
    return tuple(map(tuple, out))


def copies(nbytes: int) -> int:
    """How many copies of an operand of ``nbytes`` a measurement cycles through so that each call
    reads it from memory: twice the last-level cache in all (within the caps), at least 2."""
    cold = min(2 * _last_level_cache(), MAX_COLD_BYTES)
    return max(2, min(MAX_COPIES, -(-cold // max(nbytes, 1))))


class KVRing:
    """One-layer KV caches (1, m, Hkv, context + 1, D) for timing a decoder layer at m rows: ``views(m)``
    gives one per slot of a ring as many as ``copies`` makes, for the timed calls to cycle through (so a
    call's keys come from memory, as a decode step's do). Every row count's caches are views of the same
    slots, each sized for ``GRID``'s most rows: a cache per row count, with a layer per copy of the
    layer, made a tiny model's first timing peak at 10-19 GB, and two CP ranks timing at once ran out of
    memory. Zeroed: a call reads context positions it never wrote."""

    def __init__(self, kv_heads: int, head_dim: int, context: int, dtype: torch.dtype):
        self.row = (kv_heads, context + 1, head_dim)
        slot = max(GRID) * math.prod(self.row)
        n = copies(2 * slot * dtype.itemsize)
        self.k, self.v = torch.zeros(n, slot, dtype=dtype), torch.zeros(n, slot, dtype=dtype)
        self._views: dict[int, list] = {}

    def views(self, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every slot's (k, v) for m rows."""
        if m not in self._views:
            if m > max(GRID):
                raise ValueError(f"KVRing: {m} rows > the grid's {max(GRID)}")
            n = m * math.prod(self.row)
            self._views[m] = [(k[:n].view(1, m, *self.row), v[:n].view(1, m, *self.row))
                              for k, v in zip(self.k, self.v)]
        return self._views[m]


def machine() -> dict:
    """What a table depends on besides the operation and key."""
    lib = cbuild.library()
    cpu = cbuild._cpu_id()
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("model name")), cpu[:80])
    return {"cpu": model, "cpu_id": hashlib.sha256(cpu.encode()).hexdigest()[:16],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernels": Path(lib._name).name if lib is not None else "off",
            "gemv": gemv.current(lib) if gemv.kernel() is not None else "off"}


def describe(key: tuple) -> str:
    """``(1536, 576, torch.bfloat16)`` -> ``1536x576 bfloat16``."""
    ints = "x".join(str(k) for k in key if isinstance(k, int))
    return " ".join([ints, *(str(k).removeprefix("torch.") for k in key if not isinstance(k, int))]).strip()


def _wall(name: str, rows: int, run: Run) -> float:
    t = perf_counter()
    run()
    return perf_counter() - t


def _last_level_cache() -> int:
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            pass
    return max(sizes, default=MAX_COLD_BYTES)


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, CPU seconds used by all processes, by this one), from Linux's /proc; else None."""
    try:
        system = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    user, nice, kernel, _idle, _iowait, irq, softirq, steal = system
    busy, own = user + nice + kernel + irq + softirq + steal, int(mine[11]) + int(mine[12])  # utime + stime
    tick = os.sysconf("SC_CLK_TCK")
    return perf_counter(), busy / tick, own / tick


def _others_cores(before, after) -> float:
    """How many cores other processes (and the hypervisor) used on average between two readings; 0
    when unknown or the interval is too short for /proc's ticks to tell."""
    if before is None or after is None or after[0] - before[0] < 0.2:
        return 0.0
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def _load_or_measure(op: Operation, key: tuple, args: tuple) -> Table:
    full = {"format": FORMAT, "op": op.name, "key": describe(key), "grid": list(GRID), **machine()}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "dispatch" / f"{op.name}-{describe(key).replace(' ', '-')}-{digest}.json"
    table = _read(path, full, op)
    if table is not None:
        return table
    n = full["threads"]
    print(f"codraft: timing fast paths for {op.name} {describe(key)} ({n} thread{'s' * (n > 1)})…",
          file=sys.stderr, flush=True)
    before = _cpu_seconds()
    # the candidates' random inputs must not move the caller's RNG: a run that measures a table midway
    # samples as one that read it from the cache (a resumed run repeats the uninterrupted one)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        times = measure(op.candidates(*args))
    table = _table(ranges(times), times, op)
    others = _others_cores(before, _cpu_seconds())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if others > max(cores - n, 0) + 0.5:
        warnings.warn(f"codraft: other processes or the hypervisor kept {others:.1f} cores busy while timing {op.name} "
                      f"{describe(key)} on {n} threads: the table may pick badly, so it serves this process "
                      "only and is measured again next time", stacklevel=4)
        return dataclasses.replace(table, busy=others)
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: a concurrent reader sees a whole old file or a whole new one
    atomic_write_text(path, json.dumps({"key": full, "ranges": table.ranges,
                                        "times_us": {m: {n: t * 1e6 for n, t in ts.items()}
                                                     for m, ts in times.items()}}, indent=1))
    return table


def _table(rs, times: dict[int, dict[str, float]], op: Operation) -> Table:
    top = rs[-1][2]  # the fastest at the top of the grid
    by_rows = [top if top in op.scales else op.beyond] + [name for lo, hi, name in rs for _ in range(lo, hi + 1)]
    return Table(tuple(map(tuple, rs)), tuple(by_rows), times)


def _read(path: Path, full: dict, op: Operation) -> Table | None:
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if d["key"] != full:
            raise ValueError(f"recorded for {d['key']}")
        rs = [(int(lo), int(hi), str(name)) for lo, hi, name in d["ranges"]]
        if [lo for lo, _, _ in rs] != [1] + [hi + 1 for _, hi, _ in rs[:-1]] or rs[-1][1] != GRID[-1] \
                or any(lo > hi or name not in op.paths for lo, hi, name in rs):
            raise ValueError(f"ranges {rs} do not cover 1..{GRID[-1]} with {op.paths}")
        times = {int(m): {n: t / 1e6 for n, t in ts.items()} for m, ts in d["times_us"].items()}
        return _table(rs, times, op)
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as e:
        warnings.warn(f"codraft: dispatch table {path} unusable ({type(e).__name__}: {e}): measuring again",
                      stacklevel=4)
        return None
