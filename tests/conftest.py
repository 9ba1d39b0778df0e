"""Shared test setup: one intra-op thread per test process.

Tests run as `pytest -n 2` on 2 cores; two workers with two OpenMP threads each
oversubscribe the machine and make small ops many times slower.
"""
import pytest
import torch

from codraft.kernels import amx, cbuild, decode_ops, gemv
from codraft.tasks import ArithTask
from tiny_runs import alternating_reward, save_tiny_policy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, whatever an earlier test left set (restored after): tiny
    tensors run faster so, and immune to oversubscribed CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_kernels():
    """The C kernels looked up again in the test (and after it): for tests that change how they build."""
    caches = (cbuild.library, cbuild.function, gemv.kernel, amx.kernel, decode_ops.kernels)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


@pytest.fixture
def tiny_policy_dir(tmp_path):
    return save_tiny_policy(tmp_path / "policy")


@pytest.fixture
def varied_reward(monkeypatch):
    """A reward that differs within groups (``tiny_runs.alternating_reward``), so the advantages and the
    policy's updates are non-zero and weight comparisons mean something."""
    monkeypatch.setattr(ArithTask, "_reward", alternating_reward)
