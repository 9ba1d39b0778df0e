"""Compile the C kernels of ``codraft.kernels`` into one shared library on first use, cached; and
what tensors they take (``fits`` for activations, ``weight_fits`` for product weights: fp32 or bf16).

``gemv.c`` (few-row products) and ``decode_ops.c`` (the rest of a decode step, which calls
the products; both include ``vec.h``) are built with the system C compiler (``$CC``, default
``cc``; ~1 s) into ``$CODRAFT_CACHE/kernels``, one file per sources, flags and CPU (it uses
``-march=native``), renamed into place atomically so concurrent builders (``pytest -n``) are
safe. OpenMP comes from the compiler's libgomp, the same ``libgomp.so.1`` torch runs on, so
``torch.set_num_threads`` applies to the kernels too.

Each library's sha256 is recorded beside it when built (``kernels-KEY.so.sha256``) and checked before
it is returned: a library that does not match its record, or has none, is built again. The record sits
in the same cache, so this catches a library corrupted or replaced on its own (a torn copy, a stray
file under its name), not someone who can write the cache: they can rewrite the record too.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from codraft.atomic import atomic_write_text
from codraft.cache import cache_root, cpu_id as _cpu_id  # (tests replace _cpu_id to pose as another CPU)
from codraft.models import bf16

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemv.c", "amx.c", "decode_ops.c", "markov.c", "sampling.c"))
HEADERS = (Path(__file__).with_name("vec.h"),)  # included by the sources: part of the build's key


def build(sources: tuple[Path, ...] = SOURCES, cache_dir: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compile ``sources`` (if not cached) into one library and return its path; raises on failure.
    ``defines``: extra ``-D`` flags, e.g. ``("LANES=8",)`` for gemv.c's portable vector width."""
    cc = os.environ.get("CC", "cc")
    texts = [s.read_text() for s in (*sources, *HEADERS)]
    flags = (*FLAGS, *(f"-D{d}" for d in defines))
    key = hashlib.sha256("\0".join([*texts, cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "kernels"
    lib = folder / f"kernels-{key}.so"
    record = lib.with_name(lib.name + ".sha256")
    if _recorded(lib, record):
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            names = ", ".join(s.name for s in sources)
            raise RuntimeError(f"{cc} failed on {names}: {done.stderr.strip()[-500:]}")
        atomic_write_text(record, _sha256(tmp))  # racing builders that disagreed would only cost a rebuild
        os.replace(tmp, lib)  # atomic: concurrent builders each rename a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _recorded(lib: Path, record: Path) -> bool:
    """``lib`` is there and its sha256 is the one recorded when it was built."""
    try:
        return record.read_text().strip() == _sha256(lib)
    except OSError:  # either missing
        return False


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None when ``CODRAFT_KERNELS=0`` or it cannot be built (warned once:
    decoding then runs on torch's ops, about 2x slower on CPU)."""
    if os.environ.get("CODRAFT_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"codraft: C kernels unavailable, CPU decoding uses torch's ops (slower): {e}")
        return None


@functools.cache
def function(name: str, *argtypes):
    """The built library's C function ``name``, typed: it takes ``argtypes`` and returns nothing; None
    without a library."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = None, list(argtypes)
    return fn


def fits(*tensors: torch.Tensor) -> bool:
    """What every kernel takes as activations (and norm weights): CPU fp32 tensors that need no autograd,
    outside training's bf16 products (a no-grad forward there, e.g. the KL reference's, keeps them)."""
    return (all(t.is_cpu and t.dtype is torch.float32 for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and bf16.active() == torch.float32)


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # bf16: rollout weights, widened exactly in C


def weight_fits(*weights: torch.Tensor) -> bool:
    """What the products take as weights: contiguous CPU tensors, all fp32 or all bf16, that need no
    autograd (the C code reads their storage directly)."""
    return (all(w.is_cpu and w.dtype is weights[0].dtype and w.is_contiguous() for w in weights)
            and weights[0].dtype in WEIGHT_DTYPES
            and not (torch.is_grad_enabled() and any(w.requires_grad for w in weights)))
