"""Shared test setup: one intra-op thread per test process.

Tests run as `pytest -n 2` on 2 cores; two workers with two OpenMP threads each
oversubscribe the machine and make small ops many times slower.
"""
import pytest
import torch

from codraft.kernels import cbuild, decode_ops, gemv

torch.set_num_threads(1)


@pytest.fixture
def fresh_kernels():
    """The C kernels looked up again in the test (and after it): for tests that change how they build."""
    caches = (cbuild.library, gemv.kernel, decode_ops.kernels)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()

