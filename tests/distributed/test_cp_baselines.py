"""CP baselines (plain contiguous ring, all-gather K/V, USP) on real gloo groups of 2 and 4 ranks,
against the single-process dense masked reference: O, LSE, dQ, dK, dV (fp32, <= 1e-5 abs), on
uneven packings (sequences shorter than 2C, GQA 4 query heads over 2 KV heads). One spawn per
group size runs every case."""
from __future__ import annotations

import pytest
import torch

from codraft.parallel.baselines import METHODS, ContiguousPlan, UspPlan, comm_bytes, reset_comm_bytes, usp_heads
from codraft.parallel.comm import Group
from cp_cases import branch_case, inputs, main_case
from dist_harness import run_ranks

TOL = 1e-5
# test_cp_ring's packings without shared prefixes (the baselines have none): uneven lengths, some
# shorter than 2C (for C = 4: 1, 3, 5), GQA 4 query heads over 2 KV heads
PACKINGS = [[1, 3, 17, 40, 5], [64], [9, 2, 33]]


# (name, method, plan options); usp with U = C pads the 2 KV heads to 4 at C = 4,
# usp-u2 at C = 4 is Ulysses 2 x a zigzag ring of 2 on strided subgroups, usp-u1 is a pure zigzag ring
VARIANTS = [
    ("ring", "ring", {}),
    ("allgather", "allgather", {}),
    ("usp", "usp", {}),
    ("usp-u2", "usp", {"ulysses": 2}),
    ("usp-u1", "usp", {"ulysses": 1}),
]


def _bytes_case(rank, world):
    """Forward bytes of the zigzag ring (Group counter) and the all-gather (added by the baseline)
    equal the formula (C−1)·2·T_l·Hkv·D·4."""
    cu, t, q, k, v, _, _ = inputs(PACKINGS[0], 0)
    comm = Group.world(timeout=60)
    out = {}
    for name in ("zigzag", "allgather", "usp"):
        m = METHODS[name]
        plan = m.plan(cu, world, t)
        reset_comm_bytes(comm)
        m.attention(*(plan.shard(x, rank, dim=2) for x in (q, k, v)), m.shard(plan, rank), comm)
        out[name] = (comm_bytes(comm), plan.local_len)
    return out


def _all_cases(rank, world):
    out = {}
    for vname, method, plan_opts in VARIANTS:
        for i, lengths in enumerate(PACKINGS):
            out[f"{vname}/main{i}"] = (main_case(rank, world, lengths, i, method, plan_opts), None)
    shapes = {"eagle3_diag": (3, "diagonal", True), "dflash_block": (8, "block", False)}
    for method in ("ring", "allgather"):
        for name, (gq, local, inc) in shapes.items():
            out[f"{method}/{name}"] = branch_case(rank, world, method, PACKINGS[0], 7, gq, local, inc)
    out["bytes"] = _bytes_case(rank, world)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_baselines_match_dense_reference(world):
    results = run_ranks(_all_cases, world)
    n_cases = 0
    for rank, res in enumerate(results):
        for case, value in res.items():
            if case == "bytes":
                continue
            errs = value[0]
            n_cases += 1
            for name, e in errs.items():
                assert e <= TOL, f"C={world} rank {rank} {case}: max |{name} - ref| = {e:.3g} > {TOL}"
    assert n_cases == world * (len(VARIANTS) * len(PACKINGS) + 4)
    for case in ("ring/eagle3_diag", "ring/dflash_block", "allgather/dflash_block"):
        assert sum(res[case][1] for res in results) == 12  # every branch placed on exactly one rank
    hkv, d = 2, 8
    for rank, res in enumerate(results):
        b = res["bytes"]
        kv_local = 2 * b["zigzag"][1] * hkv * d * 4
        assert b["zigzag"][0] == (world - 1) * kv_local  # C−1 ring sends of the local K/V
        assert b["allgather"][0] == (world - 1) * kv_local
        # USP (U = C): q, k, v and O, ℓ, each (U−1)/U of the padded local tensor
        hp, hkvp = usp_heads(4, 2, world)
        t_l = b["usp"][1]
        assert b["usp"][0] == (world - 1) * t_l * 4 * (hp * d * 2 + hkvp * d * 2 + hp) // world


def test_plans_shard_and_gather():
    cu = [0, 1, 4, 21, 61]
    plan = ContiguousPlan.of(cu, 2)
    assert plan.chunks == [1, 2, 9, 20] and plan.local_len == 32
    x = torch.arange(61)[None]
    parts = [plan.shard(x, r) for r in range(2)]
    assert torch.equal(plan.unshard(parts), x)
    # the 40-token sequence: rank 0 holds positions 0..19, rank 1 positions 20..39
    assert parts[0][0, 12:32].tolist() == list(range(21, 41)) and parts[1][0, 12:32].tolist() == list(range(41, 61))
    for world, u in ((4, 4), (4, 2), (4, 1), (2, 2)):
        up = UspPlan.of(cu, world, ulysses=u)
        parts = [up.shard(x, r) for r in range(world)]
        assert torch.equal(up.unshard(parts), x)
        # a Ulysses group together holds exactly the zigzag chunks of its ring rank
        for rho in range(world // u):
            got = torch.cat([up.padded_positions(rho * u + j) + 1000 * up.sequence_ids() for j in range(u)])
            want = up.ring_plan.padded_positions(rho) + 1000 * up.ring_plan.sequence_ids()
            assert sorted(got.tolist()) == sorted(want.tolist())
    assert usp_heads(4, 2, 2) == (4, 2) and usp_heads(4, 2, 4) == (8, 4) and usp_heads(32, 8, 4) == (32, 8)
    with pytest.raises(ValueError, match="divide"):
        UspPlan.of(cu, 4, ulysses=3)
