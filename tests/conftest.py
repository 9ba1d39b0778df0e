"""Shared test setup: one intra-op thread per test process.

Tests run as `pytest -n 2` on 2 cores; two workers with two OpenMP threads each
oversubscribe the machine and make small ops many times slower.
"""
import torch

torch.set_num_threads(1)
