"""One backend's measurements for `codraft bench rollout`, in a process of its own:

    python -m codraft.bench.rollout_child JOB.json OUT.json

A process per backend, so that each one's memory is its own (vLLM also changes process-wide state: the
global RNGs, its expand kernel, environment variables) and neither inherits the other's allocator pools.

In order: the policy and draft are loaded; the resident set size is read (``rss_before_mb``); the backend is
built (``build_s``) and warmed up (one call per mode and batch, at most 16 tokens: thread pools, kernels,
codraft's dispatch tables timed on first use); the peak resident size is reset (/proc/self/clear_refs, so
one-time warm-up transients are not counted); the refits are timed (``repeats`` each, spec then plain, the
trainer's order), then for each batch ``repeats`` rounds of one call per mode, interleaved. ``peak_mb`` is
the peak resident size over the refits and timed calls minus ``rss_before_mb``: what the backend's
engines, weights, caches and calls hold beyond the policy and draft the trainer holds anyway. It includes
what the warm-up left resident (``warm_mb``): for codraft, the heap its kernel dispatch tables' timing grew
when they are timed in this process (the first time on a machine, or every time on a busy one: they are
cached only when measured undisturbed, codraft.kernels.dispatch).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from time import perf_counter

import torch

from codraft.bench import CpuMeter
from codraft.bench.rollout_sides import MODES, codraft_sides, vllm_sides
from codraft.drafts import load_draft
from codraft.policy import load_policy
from codraft.rollout.stats import SpecStats

WARMUP_TOKENS = 16


def _status_mb(key: str) -> float | None:
    """VmRSS (resident now) or VmHWM (resident at its peak) of this process, in MB."""
    try:
        found = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


def _reset_peak() -> bool:
    """Start VmHWM afresh from the current resident size (Linux >= 4.0); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(job: dict) -> dict:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(job["seed"])
    policy, _, _ = load_policy(job["policy_dir"])
    policy.eval().requires_grad_(False)
    draft = load_draft(job["draft_dir"], policy, gamma=job["gamma"])
    draft.eval()
    prompts, batches, n, repeats = job["prompts"], job["batches"], job["max_new_tokens"], job["repeats"]
    rss_before = _status_mb("VmRSS")
    t0 = perf_counter()
    if job["backend"] == "codraft":
        sides = codraft_sides(policy, draft, gamma=job["gamma"], dtype=job["dtype"])
    else:
        sides = vllm_sides(policy, draft, policy_dir=job["policy_dir"], gamma=job["gamma"], taps=job["taps"],
                           dtype=job["dtype"], kv_cache_gb=job["kv_cache_gb"], max_rows=max(batches),
                           probe=prompts[0])
    build_s = perf_counter() - t0

    def call(mode, b, tokens, seed):
        return sides.engines[mode].generate(prompts[:b], tokens, temperature=job["temperature"], seed=seed, eos_id=[])

    for b in batches:
        for mode in MODES:
            call(mode, b, min(n, WARMUP_TOKENS), 0)
    warm = _status_mb("VmRSS")
    peak_reset = _reset_peak()
    refit_s = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in ("spec", "plain"):  # (vLLM's plain engine is refit once the spec one moved on)
            t = perf_counter()
            sides.refits[mode]()
            refit_s[mode].append(perf_counter() - t)
    rows = []
    for b in batches:
        cells = {mode: {"seconds": [], "stats": [], "tokens": None} for mode in MODES}
        meter = CpuMeter()
        for rep in range(repeats):
            for mode in MODES:  # interleaved: a change in the host's speed reaches both modes alike
                t = perf_counter()
                out = call(mode, b, n, 1 + rep)
                cells[mode]["seconds"].append(perf_counter() - t)
                cells[mode]["stats"].append(dataclasses.replace(sides.engines[mode].stats))
                cells[mode]["tokens"] = [o.tokens for o in out]
        load = meter.read()
        for mode, c in cells.items():
            stats = SpecStats.pool(c["stats"])
            rows.append({"backend": job["backend"], "mode": mode, "batch": b, "seconds": c["seconds"],
                         "new_tokens": sum(map(len, c["tokens"])), "tau": stats.acceptance_length if mode == "spec"
                         else None, "refit_s": refit_s[mode], "tokens": c["tokens"],
                         "others_cores": load.get("others_cores"), "stolen_cores": load.get("stolen_cores")})
    peak = _status_mb("VmHWM")
    return {"backend": job["backend"], "rows": rows, "refit_what": sides.refit_what, "build_s": build_s,
            "rss_before_mb": rss_before, "peak_rss_mb": peak,
            "peak_mb": None if peak is None or rss_before is None else peak - rss_before,
            "warm_mb": None if warm is None or rss_before is None else warm - rss_before,
            "peak_since": "after the warm-up" if peak_reset else "the process's start (clear_refs refused)",
            "threads": torch.get_num_threads(), "ld_preload": os.environ.get("LD_PRELOAD", "")}


def main(argv: list[str]) -> None:
    job_path, out_path = argv
    Path(out_path).write_text(json.dumps(measure(json.loads(Path(job_path).read_text()))))


if __name__ == "__main__":
    main(sys.argv[1:])
