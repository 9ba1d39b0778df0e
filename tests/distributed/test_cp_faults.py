"""Context-parallel faults fail loudly and in bounded time, naming the CP rank and ring step:
a peer that never sends, a peer that dies, ranks that disagree on the packed row; `codraft train` says in
one line (a rank's carrying the rank) what is wrong with its launch."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import codraft
from codraft.cli import main
from codraft.parallel.comm import PeerError, Group, join_world, on_host
from codraft.parallel.context import ShardedRow
from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel.ring import ring_attention
from codraft.parallel.zigzag import ZigzagPlan, ZigzagShard
from dist_harness import run_ranks

TIMEOUT = 2.0


def _ring_inputs(rank, world):
    plan = ZigzagPlan.of([0, 16, 40], world)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, plan.local_len, 4) for _ in range(3))
    return q, k, v, ZigzagShard(plan, rank)


def _faulty_peer(rank, world, fault):
    """Rank 1 stays alive but never joins the ring ("silent"), or dies before it ("dead")."""
    q, k, v, shard = _ring_inputs(rank, world)
    if rank == 1:
        if fault == "dead":
            os._exit(3)
        time.sleep(3 * TIMEOUT)
        return "idle"
    t0 = time.monotonic()
    try:
        ring_attention(q, k, v, shard, Group.world(timeout=TIMEOUT))
    except PeerError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _silent_peer_in_a_mesh(rank, world):
    """PP 2 × CP 2: rank 3 (stage 1, CP rank 1) never joins its stage's ring; rank 2 waits for it."""
    mesh = build_mesh(Layout(pp=2, cp=2), timeout=TIMEOUT)
    if mesh.stage == 0:
        return "stage 0"
    if mesh.cp_rank == 1:
        time.sleep(3 * TIMEOUT)
        return "idle"
    q, k, v, shard = _ring_inputs(mesh.cp_rank, 2)
    try:
        ring_attention(q, k, v, shard, mesh.cp_group)
    except PeerError as e:
        return str(e)
    return "no error"


def _mismatched_rows(rank, world):
    cu = torch.tensor([0, 5, 12] if rank == 0 else [0, 6, 12])
    try:
        ShardedRow(SimpleNamespace(input_ids=torch.zeros(1, 12, dtype=torch.long), cu_seqlens=cu, shared=None),
                   Group.world(timeout=TIMEOUT))
    except PeerError as e:
        return str(e)
    return "no error"


def test_silent_peer_times_out_naming_rank_and_step():
    results, errors = run_ranks(_faulty_peer, 2, "silent", expect_failure=True, timeout=60)
    assert not errors, errors
    message, seconds = results[0]
    assert "CP rank 0/2: ring step 1 of 2 got no main K/V from CP rank 1" in message, message
    assert seconds < 4 * TIMEOUT


def test_dead_peer_fails_fast_naming_rank_and_step():
    results, errors = run_ranks(_faulty_peer, 2, "dead", expect_failure=True, timeout=60)
    assert 1 not in results and not errors
    message, seconds = results[0]
    assert "CP rank 0/2: ring step 1 of 2" in message and "CP rank 1" in message, message
    assert seconds < 4 * TIMEOUT


def test_in_a_pipeline_the_error_names_the_rank_and_stage():
    """A CP group of a PP × CP mesh names this rank's place in it: "CP rank 0/2" alone is ambiguous
    when every stage has one."""
    results, errors = run_ranks(_silent_peer_in_a_mesh, 4, expect_failure=True, timeout=60)
    assert not errors, errors
    assert results[2].startswith("rank 2 (pipeline stage 1/2, CP rank 0/2): ring step 1 of 2 got no main K/V "
                                 "from CP rank 1"), results[2]


def test_mismatched_cu_seqlens_is_a_clear_error():
    results = run_ranks(_mismatched_rows, 2)
    assert all("packed a different row: cu_seqlens" in m for m in results), results


def test_torchrun_ranks_do_not_all_take_one_gpu(monkeypatch):
    """device=cuda:N under torchrun would put every rank on GPU N (NCCL then fails on a duplicate GPU):
    refused before any process group or GPU is touched."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PeerError, match=r"device=cuda:1 would put every rank on GPU 1: give device=cuda"):
        join_world("cuda:1")


def _without_torchrun_error(keys: list[str]) -> str:
    procs = 2 ** len(keys)  # each key asks for 2
    return (f"codraft train: error: {' '.join(keys)} needs torchrun, one process per rank: torchrun --standalone "
            f"--nproc-per-node {procs} -m codraft train [...] {' '.join(keys)}")


@pytest.mark.parametrize("keys", [["parallel.cp=2"], ["parallel.pp=2"], ["parallel.pp=2", "parallel.cp=2"],
                                  ["parallel.dp=2"], ["parallel.dp=2", "parallel.cp=2"], ["parallel.tp=2"]])
def test_parallel_train_without_torchrun_is_one_line(tmp_path, monkeypatch, keys):
    """Without torchrun the parallel keys are one error line saying how to launch, before the run folder."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["train", *keys, f"run_dir={run}"])
    assert stop.value.code == _without_torchrun_error(keys)
    assert not run.exists()


def test_the_command_without_torchrun_exits_1_with_the_line_alone(tmp_path):
    """The same as a command: exit 1, stderr the one line (no traceback)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "codraft", "train", "parallel.cp=2", f"run_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (1, [_without_torchrun_error(["parallel.cp=2"])])


def test_each_rank_prints_its_own_error_line(tmp_path):
    """Under torchrun every rank that refuses says so in one line carrying its rank, without a traceback
    from codraft (torchrun then reports the failed ranks in its own words)."""
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "codraft", "train", "parallel.cp=3", "rollout.prompts_per_step=3", f"run_dir={run}",
                           "parallel.timeout=60"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    ours = sorted(line for line in done.stderr.splitlines() if line.startswith("codraft train"))
    assert ours == [f"codraft train (rank {r} of 2): error: parallel.dp=1 × parallel.pp=1 × parallel.cp=3 × "
                    "parallel.tp=1 = 3 ranks, but torchrun started 2 processes; launch with torchrun --nproc-per-node 3"
                    for r in (0, 1)], \
        done.stderr
    assert f'File "{Path(codraft.__file__).parent}' not in done.stderr  # no traceback through codraft's code
    assert not run.exists()


def test_gathered_objects_go_through_the_host():
    """What ranks gather (losses, metrics, optimiser state) is pickled: a CUDA tensor would come back on
    the sender's GPU index. ``on_host`` detaches every tensor and keeps the structure."""
    w = torch.ones(2, requires_grad=True)
    got = on_host({"loss": w * 2, "parts": [(w, 3)], "n": 1})
    assert got["n"] == 1 and isinstance(got["parts"], list) and isinstance(got["parts"][0], tuple)
    assert not got["loss"].requires_grad and torch.equal(got["loss"], torch.full((2,), 2.0))
    assert got["parts"][0][1] == 3 and got["parts"][0][0].device.type == "cpu"
