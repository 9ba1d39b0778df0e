"""A data-parallel or tensor-parallel rank that hangs or dies in the update: the other fails within
parallel.timeout with one error naming itself, its place in the layout and what it waited for (FSDP's
collectives, the split products' all-reduces), never a hang."""
from __future__ import annotations

import os
import time

import pytest

from codraft.errors import CodraftError
from codraft.rl.trainer import Trainer
from dist_harness import run_ranks
from tiny_runs import run_config

TIMEOUT = 5.0


def _faulty_step(tr, step, rank, fault):
    """Step ``step``, where rank 1 rolls out with the others, then never joins the update: (this rank's
    error, seconds until it) or None."""
    if rank == 1:
        tr.update = (lambda *a: time.sleep(2 * TIMEOUT)) if fault == "hang" else (lambda *a: os._exit(1))
    t0 = time.monotonic()
    try:
        tr.step(step)
    except CodraftError as e:
        return str(e), time.monotonic() - t0
    return None


def _rank(rank, world, policy_dir, run_dir, fault):
    tr = Trainer(run_config(policy_dir, run_dir, 1, extra=["parallel.dp=2", f"parallel.timeout={TIMEOUT}"]),
                 progress=False)
    return _faulty_step(tr, 0, rank, fault)


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


def _stage_rank(rank, world, policy_dir, run_dir, fault):
    """dp=2 × pp=2, each stage sharded over its two data ranks: rank 1 (stage 0, DP rank 1) runs step 0, then
    never joins step 1's update (the pipeline and its channels are built by then)."""
    tr = Trainer(run_config(policy_dir, run_dir, 2, extra=["parallel.dp=2", "parallel.pp=2", "parallel.taps=p2p",
                                                           "rollout.prompts_per_step=4", f"parallel.timeout={TIMEOUT}"]),
                 progress=False)
    tr.step(0)
    return _faulty_step(tr, 1, rank, fault)


def test_a_rank_of_a_sharded_stage_that_hangs_is_reported(tmp_path, tiny_policy_dir):
    """(A rank that dies surfaces sooner: the connection closes; the one-stage test above has both.)"""
    results, _ = run_ranks(_stage_rank, 4, tiny_policy_dir, tmp_path / "run", "hang", pg_timeout=TIMEOUT,
                           timeout=180, expect_failure=True)
    # its stage's other rank waits in FSDP's all-gather; the next stage's ranks wait for activations
    message, seconds = results[0]
    assert message.startswith("rank 0 (pipeline stage 0/2, CP rank 0/1, DP rank 0/2): the stage's forward and "
                              "backward (FSDP's all-gathers and gradient sums) failed: a data-parallel peer died or "
                              "did not answer within parallel.timeout"), message
    for rank in (2, 3):
        message, _ = results[rank]
        assert message.startswith(f"rank {rank} (pipeline stage 1/2, CP rank 0/1, DP rank {rank - 2}/2): no "
                                  "activations of micro-batch 0 from stage 0"), (rank, message)
    assert all("\n" not in results[r][0] for r in (0, 2, 3))
    assert seconds < 4 * TIMEOUT


def _tp_rank(rank, world, policy_dir, run_dir):
    tr = Trainer(run_config(policy_dir, run_dir, 1, extra=["parallel.tp=2", f"parallel.timeout={TIMEOUT}"]),
                 progress=False)
    return _faulty_step(tr, 0, rank, "hang")


def test_a_tensor_parallel_rank_that_hangs_is_reported(tmp_path, tiny_policy_dir):
    """parallel.tp=2: rank 1 never joins the update; rank 0 waits in the split products' first all-reduce."""
    results, _ = run_ranks(_tp_rank, 2, tiny_policy_dir, tmp_path / "run", pg_timeout=TIMEOUT, timeout=120,
                           expect_failure=True)
    message, seconds = results[0]
    assert message.startswith("rank 0 (pipeline stage 0/1, CP rank 0/1, TP rank 0/2): the policy's forward "
                              "(tensor-parallel all-reduces) failed: a tensor-parallel peer died or did not answer "
                              "within parallel.timeout"), message
    assert "\n" not in message and seconds < 4 * TIMEOUT
