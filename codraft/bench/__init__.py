"""Benchmarks behind `codraft bench ...`: each prints a table and writes every figure to JSON.

Benchmarks are never run as tests. Shared helpers here: machine description, an aligned-text
table, and a CPU-contention meter (how much of the machine other processes used meanwhile,
which is what makes timings on a shared host noisy).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from codraft.kernels import cbuild
from codraft.kernels import gemv as gemv_kernel  # (not `gemv`: importing codraft.bench.gemv rebinds that name)


def machine_info(kernels: bool = True) -> dict:
    """The machine and versions a benchmark ran on; with ``kernels``, the decode kernels' tuning too
    (which builds and tunes them on first use on a machine: a few seconds, for the benches that decode)."""
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "platform": platform.platform(), "python": platform.python_version(),
            "processor": _cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if kernels:
        info["gemv_tuning"] = gemv_kernel.current(cbuild.library()) if gemv_kernel.kernel() is not None else "off"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what the kernels and torch dispatch on


def cpu_flags() -> dict[str, bool]:
    """Which of ``CPU_FLAGS`` this CPU has (/proc/cpuinfo; all False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {f: f in flags for f in CPU_FLAGS}


class CpuMeter:
    """CPU seconds this process used vs. all processes on the machine since ``start()`` (Linux).

    ``others_cores`` = mean number of cores busy with *other* processes: on a 2-core machine,
    a value near 1 means half the machine was taken while we measured. ``stolen_cores`` = mean
    number of cores' worth of time the hypervisor ran other guests while this VM's vCPUs wanted to
    run (/proc/stat's steal): no process here shows it, yet it slows every parallel call (40 % steal
    made a 2-thread 8192x72 product 50x slower than on one thread on a 2-core Xeon).
    """

    def __init__(self):
        self.start()

    @staticmethod
    def _usage() -> tuple[float, float] | None:
        """(CPU seconds all processes used, seconds the hypervisor ran other guests) since boot, from
        one reading of /proc/stat's first line (user nice system idle iowait irq softirq steal)."""
        try:
            ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        steal = ticks[7] if len(ticks) > 7 else 0
        hz = os.sysconf("SC_CLK_TCK")
        return (sum(ticks[:8]) - idle - steal) / hz, steal / hz

    @classmethod
    def _machine_busy_s(cls) -> float | None:
        usage = cls._usage()
        return None if usage is None else usage[0]

    def start(self):
        import time
        self._wall, self._own, self._usage0 = time.perf_counter(), time.process_time(), self._usage()

    def read(self) -> dict:
        import time
        wall = time.perf_counter() - self._wall
        own = time.process_time() - self._own
        usage = self._usage()
        out = {"wall_s": wall, "own_cpu_s": own}
        if usage is not None and self._usage0 is not None and wall > 0:
            (busy, stolen), (busy0, stolen0) = usage, self._usage0
            out["others_cores"] = max(0.0, (busy - busy0 - own) / wall)
            out["stolen_cores"] = max(0.0, (stolen - stolen0) / wall)
        return out


def median(xs):
    return statistics.median(xs) if xs else None


def format_table(rows: list[list], headers: list[str]) -> str:
    """Plain aligned text: numbers right-aligned, text left-aligned."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in range(len(headers))]

    def line(vals):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def write_json(result: dict, path, log=print) -> None:
    """A bench's result as JSON at ``path`` (its folder made), and a line saying so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    log(f"\nwrote {path}")
