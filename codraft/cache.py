"""Where codraft caches what it builds or measures once: converted SmolLM2, the tiny warm start,
offline drafts, compiled kernels, timings. ``$CODRAFT_CACHE`` (unset or empty: ``~/.cache/codraft``).
A timing is only valid on the machine that made it: ``machine_key`` is what such a file is keyed by."""
from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import torch


def cache_root() -> Path:
    return Path(os.environ.get("CODRAFT_CACHE") or Path.home() / ".cache" / "codraft")


def machine_key(device: torch.device) -> dict:
    """What a timing depends on besides the work timed: device, torch's threads, the processor's name
    and (CPU) a hash of its feature flags, since virtual machines often report a generic name."""
    return {"device": str(device), "threads": torch.get_num_threads(), "processor": _processor(device),
            "cpu_flags": _cpu_flags() if device.type == "cpu" else None}


def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                platform.processor() or platform.machine())


def _cpu_flags() -> str | None:
    flags = sorted({line for line in _cpuinfo() if line.startswith(("flags", "Features"))})
    return hashlib.sha256("\n".join(flags).encode()).hexdigest()[:16] if flags else None


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
