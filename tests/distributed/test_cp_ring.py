"""Zigzag ring attention (main + branch) on real gloo groups of 2 and 4 ranks, against a
single-process dense masked reference: outputs, LSE, dQ, dK, dV (fp32, ≤ 1e-5 abs)."""
from __future__ import annotations

import pytest
import torch

from codraft.parallel.zigzag import ZigzagPlan
from cp_cases import branch_case, main_case
from dist_harness import run_ranks

TOL = 1e-5
# uneven lengths, some shorter than 2C (for C = 4: 1, 3, 5), GQA 4 query heads over 2 KV heads;
# with shared prefixes (PackedCausal.prefix: two GRPO groups, prompts of 40 and 9 tokens)
PACKINGS = [([1, 3, 17, 40, 5], ()), ([64], ()), ([9, 2, 33], ()),
            ([40, 5, 1, 12, 9, 3, 7], (-1, 0, 0, 0, -1, 4, 4))]


def _all_cases(rank, world):
    out = {}
    for i, (lengths, prefix) in enumerate(PACKINGS):
        out[f"main{i}"] = (main_case(rank, world, lengths, i, prefix=prefix), None)
    shapes = {"eagle3_diag": (3, "diagonal", True), "dflash_block": (8, "block", False),
              "dspark_block": (4, "block", False)}
    for name, (gq, local, inc) in shapes.items():
        out[name] = branch_case(rank, world, "zigzag", PACKINGS[0][0], 7, gq, local, inc)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_dense_reference(world):
    results = run_ranks(_all_cases, world)
    for rank, res in enumerate(results):
        for case, (errs, _) in res.items():
            for name, e in errs.items():
                assert e <= TOL, f"C={world} rank {rank} {case}: max |{name} - ref| = {e:.3g} > {TOL}"
    # every branch was placed somewhere: the ranks' local counts add up to all 12 anchors
    for case in ("eagle3_diag", "dflash_block"):
        assert sum(res[case][1] for res in results) == 12


def test_zigzag_plan_shards_and_gathers():
    plan = ZigzagPlan.of([0, 1, 4, 21, 61], 2)
    assert plan.chunks == [1, 1, 5, 10] and plan.local_len == 34
    assert plan.padding_ratio == pytest.approx(2 * 34 / 61 - 1)
    x = torch.arange(61)[None]
    parts = [plan.shard(x, r) for r in range(2)]
    assert torch.equal(plan.unshard(parts), x)
    # rank r holds chunks r and 2C-1-r of every sequence: for the 40-token sequence (c = 10), rank 0
    # holds positions 0..9 and 30..39, rank 1 positions 10..29
    assert parts[0][0, 14:34].tolist() == list(range(21, 31)) + list(range(51, 61))
    assert parts[1][0, 14:34].tolist() == list(range(31, 51))
    # the 1-token sequence: rank 0 holds it, rank 1 one padding row (-1 in the index, `fill` in the data)
    assert plan.global_index(1)[0] == -1 and parts[1][0, 0] == 0
    with pytest.raises(ValueError, match="padding tail"):
        ZigzagPlan.of([0, 5], 2, total=7)
