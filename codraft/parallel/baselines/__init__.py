"""Context-parallel attention baselines for the zigzag ring: plain (contiguous) ring, all-gather
K/V, and USP (Ulysses all-to-all + ring). Same contract as ``ring.ring_attention``:

    fn(q (B,H,T_l,D), k/v (B,Hkv,T_l,D), shard, comm) -> O (B,H,T_l,D) fp32, ℓ (B,H,T_l) fp32

causal attention of the packed sequences of one row, sharded over the C ranks of ``comm`` as
``shard`` describes; differentiable (dQ, dK, dV, including the upstream gradient of ℓ); every
rank must make the same calls (they are collective). Each method has its own sharding plan
(``shard``/``unshard``/``global_index``/``padded_positions`` as ``ZigzagPlan``) and per-rank view
(``total``/``index``/``positions()`` as ``ZigzagShard``); the generic parts are ZigzagPlan's own
functions, shared, not copied (``_RowPlan``). ``METHODS`` names them all for tests and benchmarks.
The methods, one module each:

* the plain (contiguous) ring: ``plain_ring``;
* all-gather K/V: ``allgather``;
* USP (Ulysses all-to-all + ring): ``usp``;

their sharding plans are in ``plans``, the helpers they share in ``common``; each module's
docstring describes its method.

Branches (draft queries over the main keys, see ``ring.ring_branch_attention``): the plain ring
and all-gather have ``*_branch_attention`` with ring_branch_attention's contract; USP does not
(branch queries live on their anchor's rank and would need an uneven all-to-all of their own:
SpecForge's USP has EAGLE-3 TTT only, whose steps are ordinary causal calls, and no block drafts).

Kernels: every method computes its blocks with ``blocks.block_forward``/``block_backward``, as
the zigzag ring does: square causal diagonals and unmasked blocks as ``Block(..., causal=...)``
(PyTorch's CPU flash kernel), masked branch blocks by the explicit form. So the methods differ in
layout, schedule and communication only.

Communicated bytes: the ring's point-to-point bytes are counted by ``Group.sent_bytes``; the
collectives here add what a bandwidth-optimal algorithm sends per rank (all-gather and
reduce-scatter: (C−1)·local bytes; all-to-all: (U−1)/U of the input) to the same counter.
``comm_bytes(comm)`` also adds the ring subgroups USP creates.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from codraft.parallel.baselines.allgather import allgather_attention, allgather_branch_attention
from codraft.parallel.baselines.plain_ring import contiguous_rule, plain_ring_attention, plain_ring_branch_attention
from codraft.parallel.baselines.plans import ContiguousPlan, ContiguousShard, UspPlan, UspShard
from codraft.parallel.baselines.usp import comm_bytes, reset_comm_bytes, usp_attention, usp_heads
from codraft.parallel.ring import ring_attention, ring_branch_attention
from codraft.parallel.zigzag import ZigzagPlan, ZigzagShard

class Method(NamedTuple):
    """A CP attention method: how to shard a row, and its attention functions."""
    plan: Callable   # (cu_seqlens, world, total) -> plan
    shard: Callable  # (plan, rank, device) -> per-rank view
    attention: Callable  # (q, k, v, shard, comm, scale=None) -> (O, ℓ)
    branch: Callable | None  # ring_branch_attention's contract, or None: the method cannot place branches


METHODS: dict[str, Method] = {
    "zigzag": Method(ZigzagPlan.of, ZigzagShard, ring_attention, ring_branch_attention),
    "ring": Method(ContiguousPlan.of, ContiguousShard, plain_ring_attention, plain_ring_branch_attention),
    "allgather": Method(ZigzagPlan.of, ZigzagShard, allgather_attention, allgather_branch_attention),
    "usp": Method(UspPlan.of, UspShard, usp_attention, None),
}

__all__ = ["ContiguousPlan", "ContiguousShard", "UspPlan", "UspShard", "plain_ring_attention",
           "plain_ring_branch_attention", "allgather_attention", "allgather_branch_attention", "usp_attention",
           "contiguous_rule", "usp_heads", "comm_bytes", "reset_comm_bytes",
           "METHODS", "Method"]
