"""Peak memory and time of a model's first decoder-layer timing (``fast_layers.layer_table`` on a fresh
dispatch cache), and the table it picks (docs/real-preset.md, "Session 31").

Usage: CODRAFT_CACHE=/tmp/fresh python scripts/first_timing_memory.py [THREADS] [POLICY]
(THREADS default 1; POLICY default tiny-sft, or smollm2-135m). Point ``CODRAFT_CACHE`` at a folder
without ``dispatch/`` (a copy of the usual cache without it keeps the policy's warm start), or the
table is read, not timed.
"""
import resource
import sys
import time

import torch

from codraft.kernels import fast_layers
from codraft.policy import load_policy

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
model, _, _ = load_policy(sys.argv[2] if len(sys.argv) > 2 else "tiny-sft")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
t = time.perf_counter()
table = fast_layers.layer_table(model.layers[0])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(f"{threads} thread(s): {time.perf_counter() - t:.1f} s, peak RSS {before:.2f} GB before, {peak:.2f} GB after")
print("ranges:", table.ranges)
