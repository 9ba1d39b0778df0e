"""bf16 products on weights packed in panels: this build against another, same process, interleaved
(docs/bench-spec.md, "The Intel Xeon again" and session 25). SmolLM2-135M's 210 decoder projections,
random bf16 values, packed (~270 MB: they stream from memory as in a decode step).

Usage: python scripts/panel_tile_ab.py [ROUNDS] [ROW_TILE=4[,NAME=VALUE...] | REV]
The other build: gemv.c with -D flags (default ROW_TILE=4: tiles of 4 input rows, the AVX2 register
budget, against AVX-512's 8), or gemv.c as committed at a git revision (e.g. HEAD). Prints, per row
count, ms for all 210 products with each build (median over the rounds) and the median of the paired
ratios (other / this build), and checks both give the same outputs.
"""
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import torch

from codraft.kernels import cbuild, gemv, panels

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 64)


def other_build(against: str, tmp: str) -> Path:
    """gemv.c built with the -D flags ``against`` (NAME=VALUE,...), or as committed at revision ``against``."""
    if "=" in against:
        return cbuild.build(defines=tuple(against.split(",")), cache_dir=Path(tmp))
    src = Path(cbuild.SOURCES[0])
    old = Path(tmp) / src.name
    old.write_text(subprocess.run(["git", "show", f"{against}:./{src.name}"], capture_output=True,
                                  text=True, check=True, cwd=src.parent).stdout)
    shutil.copy(src.with_name("vec.h"), Path(tmp) / "vec.h")
    return cbuild.build((old,), cache_dir=Path(tmp))


def main(rounds: int = 7, against: str = "ROW_TILE=4"):
    torch.set_num_threads(2)
    gemv.kernel()  # this machine's tuning, set on the default library
    here = cbuild.library()
    with tempfile.TemporaryDirectory() as tmp:
        other = ctypes.CDLL(str(other_build(against, tmp)))
    other.set_tuning(2, here.get_prefetch(2, 0), here.get_prefetch(2, 1), here.get_pair_rows(2))
    libs = {against: other, "this build": here}
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).bfloat16() for _ in range(30) for o, i in SHAPES]
    packed = [panels.pack(w, room) for w, room in zip(ws, panels.empty(ws))]
    for name, lib in libs.items():
        lib.gemv_panels_bf16.restype = None
        lib.gemv_panels_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    print(f"{'rows':>4} " + " ".join(f"{n:>11}" for n in libs) + "  ratio")
    for m in ROWS:
        xs = {i: torch.randn(m, i, generator=g) for i in (576, 1536)}
        ys = {name: [torch.empty(m, w.shape[0]) for w in ws] for name in libs}

        def run(name):
            fn = libs[name].gemv_panels_bf16
            t = perf_counter()
            for w, p, y in zip(ws, packed, ys[name]):
                fn(xs[w.shape[1]].data_ptr(), p.data_ptr(), y.data_ptr(), m, w.shape[1], w.shape[0])
            return perf_counter() - t
        times = {name: [] for name in libs}
        for r in range(rounds + 1):
            for name in (list(libs) if r % 2 else list(libs)[::-1]):
                t = run(name)
                if r:
                    times[name].append(t)
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(*ys.values()))
        ratio = statistics.median(a / b for a, b in zip(*times.values()))
        print(f"{m:>4} " + " ".join(f"{1e3 * statistics.median(t):>11.2f}" for t in times.values())
              + f"  {ratio:.3f}{'' if same else '  OUTPUTS DIFFER'}")


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
