"""Per-step seeds: every training loop reseeds each step from (run seed, step index), so a
resumed run repeats an uninterrupted one's draws exactly and no RNG state has to line up."""
from __future__ import annotations


def step_seed(seed: int, step: int) -> int:
    """A distinct 62-bit seed for each (seed, step); used for torch's and Python's generators."""
    return (seed * 1_000_003 + step * 7919) % (2 ** 62)
