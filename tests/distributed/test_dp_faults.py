"""A data-parallel rank that hangs or dies in the update: the other fails within parallel.timeout with one
error naming itself, its place in the layout and what it waited for (FSDP's collectives), never a hang."""
from __future__ import annotations

import os
import time

import pytest

from codraft.parallel.comm import CPError
from codraft.rl.trainer import Trainer
from dist_harness import run_ranks
from tiny_runs import run_config

TIMEOUT = 5.0


def _rank(rank, world, policy_dir, run_dir, fault):
    tr = Trainer(run_config(policy_dir, run_dir, 1, extra=["parallel.dp=2", f"parallel.timeout={TIMEOUT}"]),
                 progress=False)
    if rank == 1:  # rolls out with rank 0, then never joins the update
        tr.update = (lambda *a: time.sleep(3 * TIMEOUT)) if fault == "hang" else (lambda *a: os._exit(1))
    t0 = time.monotonic()
    try:
        tr.step(0)
    except CPError as e:
        return str(e), time.monotonic() - t0
    return None


@pytest.mark.parametrize("fault", ["hang", "die"])
def test_a_data_parallel_rank_that_hangs_or_dies_is_reported(tmp_path, tiny_policy_dir, fault):
    results, _ = run_ranks(_rank, 2, tiny_policy_dir, tmp_path / "run", fault, pg_timeout=TIMEOUT, timeout=120,
                           expect_failure=True)
    message, seconds = results[0]
    assert message.startswith("rank 0 (pipeline stage 0/1, CP rank 0/1, DP rank 0/2): the policy's forward (FSDP "
                              "all-gathers) failed: a data-parallel peer died or did not answer within "
                              "parallel.timeout"), message
    assert "\n" not in message
    assert seconds < 4 * TIMEOUT
