"""Learning-rate multipliers (for ``LambdaLR``), shared by the SFT warm start and the RL trainer."""
from __future__ import annotations

import math


def warmup(steps: int):
    """Linear from 1/steps to 1 over the first ``steps`` steps, then 1."""
    return lambda s: min(1.0, (s + 1) / max(steps, 1))


def warmup_cosine(warmup_steps: int, total: int, floor: float):
    """``warmup``, times a cosine from 1 down to ``floor`` at step ``total`` (held after it)."""
    up = warmup(warmup_steps)
    return lambda s: up(s) * (0.5 * (1 + math.cos(math.pi * min(s, total) / max(total, 1))) * (1 - floor) + floor)
