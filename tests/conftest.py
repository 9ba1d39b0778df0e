"""Shared test setup: one intra-op thread per test process.

Tests run as `pytest -n 2` on 2 cores; two workers with two OpenMP threads each
oversubscribe the machine and make small ops many times slower.
"""
import fcntl
import os

import pytest
import torch

from codraft.kernels import amx, cbuild, decode_ops, gemv
from codraft.tasks import ArithTask
from codraft.policy.warmstart import SFTConfig, warm_start
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


def _shared(tmp_path_factory, name: str):
    """A folder every xdist worker of this run sees (the workers' common base; this run's base without
    xdist), and a lock held while it is filled: what one worker builds, the others reuse."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return root, lock


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory):
    """The C kernels built once per run with 8 lanes (what AVX2 machines get; this one may build 16)."""
    root, lock = _shared(tmp_path_factory, "portable-kernels")
    with lock:
        return cbuild.build(cache_dir=root, defines=("LANES=8",))


@pytest.fixture(scope="session")
def tiny_tools_policy(tmp_path_factory):
    """tiny-tools, shortened (enough SFT steps to write tool calls in the lookup format), trained once per
    run for every module that needs it."""
    root, lock = _shared(tmp_path_factory, "tiny-tools")
    with lock:
        return warm_start(SFTConfig(steps=150, val_size=40), cache_dir=root / "policy", progress=False,
                          name="tiny-tools")


@pytest.fixture(scope="module")
def vllm_restored():
    """What a vLLM engine built in this process changes for good, put back after the module: its CPU worker
    replaces ``torch.set_num_threads`` with a no-op, sets the thread count and pins this thread to one core
    (its OpenMP binding). Left so, every later test of this worker would run pinned beside the other worker
    (and the ranks it forks would inherit it)."""
    set_num_threads, threads, cores = torch.set_num_threads, torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cores)
