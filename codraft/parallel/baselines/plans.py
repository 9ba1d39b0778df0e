"""The baselines' sharding plans and per-rank views: ``ContiguousPlan``/``ContiguousShard`` (plain
ring) and ``UspPlan``/``UspShard`` (USP); the all-gather baseline uses ``ZigzagPlan``/``ZigzagShard``."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from codraft.parallel.zigzag import ZigzagPlan, ZigzagShard

_Z, _ZS = ZigzagPlan.__dict__, ZigzagShard.__dict__


# ---- plans ------------------------------------------------------------------------------------


class _RowPlan:
    """The parts of ``ZigzagPlan`` that only need ``chunks``/``sequence_ids``/``padded_positions``
    (global index, shard, unshard, padding ratio), shared with the plans below. A subclass defines
    which padded positions each rank holds; it is not a ZigzagPlan (the zigzag ring refuses it).
    No shared prompt prefixes (``ZigzagPlan.prefix``): every sequence is self-contained."""
    prefix = ()  # (ZigzagPlan.prefix: none here)
    lengths = _Z["lengths"]
    total = _Z["total"]
    padding_ratio = _Z["padding_ratio"]
    global_index = _Z["global_index"]
    shard = _Z["shard"]
    unshard = _Z["unshard"]
    _check_rank = _Z["_check_rank"]

    def rope_positions(self, rank: int) -> torch.Tensor:
        return self.padded_positions(rank)


def _validated(cu_seqlens, world: int, total: int | None) -> tuple[int, ...]:
    return ZigzagPlan.of(cu_seqlens, world, total).bounds


class _RowShard:
    """``ZigzagShard``'s ``total``/``index``/``positions()`` over any plan here."""
    total = _ZS["total"]
    index = _ZS["index"]

    def positions(self) -> torch.Tensor:
        """RoPE positions: the padded position inside the sequence (padding rows continue counting)."""
        return self.plan.padded_positions(self.rank).to(self.device)


@dataclass(frozen=True)
class ContiguousPlan(_RowPlan):
    """Plain ring sharding: sequence i padded to C·c_i (c_i = ceil(L_i / C)), rank r holds its
    chunk r, positions [r·c_i, (r+1)·c_i). Local row = its sequences' chunks, in sequence order."""
    bounds: tuple[int, ...]
    world: int

    @classmethod
    def of(cls, cu_seqlens, world: int, total: int | None = None) -> "ContiguousPlan":
        return cls(_validated(cu_seqlens, world, total), world)

    @cached_property
    def chunks(self) -> list[int]:
        return [-(-n // self.world) for n in self.lengths]

    @property
    def local_len(self) -> int:
        return sum(self.chunks)

    @cached_property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for c in self.chunks:
            out.append(o)
            o += c
        return out

    def padded_positions(self, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        parts = [torch.arange(rank * c, (rank + 1) * c) for c in self.chunks]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def sequence_ids(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.chunks)), torch.tensor(self.chunks))


@dataclass(frozen=True)
class ContiguousShard(_RowShard):
    plan: ContiguousPlan
    rank: int
    device: torch.device | str = "cpu"


@dataclass(frozen=True)
class UspPlan(_RowPlan):
    """USP sharding (``usp`` module docstring): Ulysses degree ``ulysses`` = U, ring degree R = C/U.
    Sequence i is padded to 2C·c_i (c_i = ceil(L_i / 2C), as zigzag); rank ρ·U + υ holds
    positions [(k·U + υ)·c_i, +c_i) for the zigzag chunks k = ρ and 2R−1−ρ of the ring."""
    bounds: tuple[int, ...]
    world: int
    ulysses: int

    chunks = _Z["chunks"]
    local_len = _Z["local_len"]
    offsets = _Z["offsets"]
    sequence_ids = _Z["sequence_ids"]

    @classmethod
    def of(cls, cu_seqlens, world: int, total: int | None = None, ulysses: int | None = None) -> "UspPlan":
        bounds = _validated(cu_seqlens, world, total)
        u = world if ulysses is None else int(ulysses)
        if u < 1 or world % u:
            raise ValueError(f"the Ulysses degree must divide the CP size {world}, got {u}")
        return cls(bounds, world, u)

    @property
    def ring(self) -> int:
        return self.world // self.ulysses

    def padded_positions(self, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        rho, ups = divmod(rank, self.ulysses)
        parts = []
        for c in self.chunks:
            for k in (rho, 2 * self.ring - 1 - rho):
                start = (k * self.ulysses + ups) * c
                parts.append(torch.arange(start, start + c))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    @cached_property
    def ring_plan(self) -> ZigzagPlan:
        """The zigzag plan of the ring group: the sequences at their padded lengths 2C·c_i, so
        that its chunks are the unions U·c_i of the Ulysses pieces (padding rows are real rows
        to the ring: they lie after every real token of their sequence, nothing real sees them)."""
        cu = [0]
        for c in self.chunks:
            cu.append(cu[-1] + 2 * self.world * c)
        return ZigzagPlan.of(cu, self.ring)


@dataclass(frozen=True)
class UspShard(_RowShard):
    plan: UspPlan
    rank: int
    device: torch.device | str = "cpu"

    @cached_property
    def ring_shard(self) -> ZigzagShard:
        return ZigzagShard(self.plan.ring_plan, self.rank // self.plan.ulysses, self.device)

    @cached_property
    def ring_order(self) -> torch.Tensor:
        """(U·T_l,) for each row of the ring layout, its row in the all-to-all output (the Ulysses
        group's local rows concatenated in rank order)."""
        p, u = self.plan, self.plan.ulysses
        rho = self.rank // u
        seq = p.sequence_ids()
        span = 2 * p.world * max(p.chunks, default=1)
        got = torch.cat([seq * span + p.padded_positions(rho * u + j) for j in range(u)])
        want = p.ring_plan.sequence_ids() * span + p.ring_plan.padded_positions(rho)
        order = torch.empty_like(want)
        order[torch.argsort(want)] = torch.argsort(got)
        return order.to(self.device)
