"""Where codraft caches what it builds or measures once: converted SmolLM2, the tiny warm start,
offline drafts, compiled kernels, timings. ``$CODRAFT_CACHE`` (unset or empty: ``~/.cache/codraft``).
A timing is only valid on the machine that made it: ``machine_key`` is what such a file is keyed by."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch


def cache_root() -> Path:
    return Path(os.environ.get("CODRAFT_CACHE") or Path.home() / ".cache" / "codraft")


def keyed_file(folder: Path, key: dict) -> tuple[dict, Path]:
    """A measurement's file under ``folder``, named by a hash of its ``key``, and the key as JSON reads it
    back (what a file's recorded key is compared with: a file recorded elsewhere has another name, and a
    collision another key)."""
    key = json.loads(json.dumps(key, default=str))
    return key, folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"


def machine_key(device: torch.device) -> dict:
    """What a timing depends on besides the work timed: device, torch's threads, the processor's name
    and (CPU) a hash of ``cpu_id``, since virtual machines often report a generic name."""
    cpu = cpu_id() if device.type == "cpu" else None
    return {"device": str(device), "threads": torch.get_num_threads(), "processor": _processor(device, cpu),
            "cpu_id": hashlib.sha256(cpu.encode()).hexdigest()[:16] if cpu is not None else None}


def cpu_id() -> str:
    """What -march=native and a CPU timing depend on: the CPU model and its feature flags (their
    /proc/cpuinfo lines), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({l for l in lines if l.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _processor(device: torch.device, cpu: str | None) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return next((l.split(":", 1)[1].strip() for l in (cpu or "").splitlines() if l.startswith("model name")),
                platform.processor() or platform.machine())
