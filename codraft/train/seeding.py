"""Per-step seeds: every training loop reseeds each step from (run seed, step index), so a
resumed run repeats an uninterrupted one's draws exactly and no RNG state has to line up."""
from __future__ import annotations

import torch


def step_seed(seed: int, step: int) -> int:
    """A distinct 62-bit seed for each (seed, step); used for torch's and Python's generators."""
    return (seed * 1_000_003 + step * 7919) % (2 ** 62)


def sequence_seeds(step_seed: int, first: int, n: int) -> torch.Tensor:
    """(n,) int64 seeds of a step's sequences first..first+n-1, numbered in the step's rollout order,
    for the random choices a draft loss makes per sequence (``DraftBatch.seeds``: the block drafts'
    anchors). A seed depends on (seed, step, sequence) only, never on a micro-batch, row or rank, so
    the step draws the same at every layout (one process, CP, PP, any micro-batches) and on resume."""
    return torch.tensor([_mix(_mix(step_seed) + i) for i in range(first, first + n)], dtype=torch.long)


def _mix(x: int) -> int:
    """splitmix64's finaliser, cut to 63 bits (an int64 and a valid ``manual_seed``)."""
    x = (x + 0x9E3779B97F4A7C15) % 2 ** 64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2 ** 64
    return (x ^ (x >> 31)) % 2 ** 63
