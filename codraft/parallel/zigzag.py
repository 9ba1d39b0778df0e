"""Zigzag sharding of a packed row over C context-parallel ranks.

Each packed sequence i (length L_i) is padded to a multiple of 2C (never to the longest
sequence) and cut into 2C chunks of c_i = ceil(L_i / 2C) tokens; rank r holds chunks r and
2C−1−r. Causal attention over chunk k costs ∝ k, so the pair (r, 2C−1−r) gives every rank the
same work. A rank's local row is, sequence after sequence, its two chunks in order:

    local = [seq 0: chunk r, chunk 2C−1−r | seq 1: chunk r, chunk 2C−1−r | ...]

Every rank has the same local length Σ 2c_i, and local row j of sequence i on rank s is chunk
s or 2C−1−s of that sequence: ring steps need no index exchange, only the plan. Padding rows sit
at the end of their sequence (padded positions ≥ L_i), so causally no real token sees them; they
map to global position −1 and are dropped by ``unshard``.

Shared prompts (``PackedCausal.prefix``: a GRPO group's prompt packed once, each completion
seeing it whole and then itself causally) stay shared. Every segment — the prompt, each
completion — is sharded as its own sequence, so zigzag's balance and step rule hold unchanged,
and ``prefix[i]`` adds to segment i's causal attention the whole of segment ``prefix[i]``: the
ring visits it anyway, and segment i's rows attend to it at every step (ring.py), which costs
the same on every rank. Expanding the prompt per completion instead would multiply the long
part of a long-context batch by the group size. RoPE positions (``positions``) continue after
the prefix, as in ``PackedCausal.positions()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ZigzagPlan:
    """The sharding of one packed row (``cu_seqlens``, host ints) over ``world`` ranks; ``prefix``
    as in ``PackedCausal`` (segment i also sees all of segment prefix[i]; empty or -1: nothing)."""
    bounds: tuple[int, ...]
    world: int
    prefix: tuple[int, ...] = ()

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor | list[int], world: int, total: int | None = None,
           prefix: tuple[int, ...] = ()) -> "ZigzagPlan":
        bounds = tuple(int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
        if world < 1:
            raise ValueError(f"context-parallel size must be >= 1, got {world}")
        if not bounds or bounds[0] != 0 or any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and increase strictly; got {list(bounds)}")
        if total is not None and bounds[-1] != total:
            raise ValueError(f"zigzag sharding needs a row without a padding tail: cu_seqlens ends at "
                             f"{bounds[-1]}, the row has {total} tokens")
        prefix = tuple(int(p) for p in prefix) if any(p >= 0 for p in prefix) else ()
        if prefix and (len(prefix) != len(bounds) - 1 or any(not -1 <= p < i for i, p in enumerate(prefix))):
            raise ValueError(f"prefix needs one entry per segment, each -1 or an earlier segment; got {list(prefix)}")
        return cls(bounds, world, prefix)

    @classmethod
    def of_layout(cls, layout, world: int) -> "ZigzagPlan":
        """The plan of a ``PackedCausal`` layout (its segments and shared prefixes)."""
        return cls.of(layout.cu_seqlens, world, layout.total, layout.prefix)

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    @cached_property
    def chunks(self) -> list[int]:
        """c_i: tokens per chunk of sequence i (its padded length is 2C·c_i)."""
        two_c = 2 * self.world
        return [-(-n // two_c) for n in self.lengths]

    @property
    def local_len(self) -> int:
        """Rows every rank holds: Σ 2·c_i."""
        return 2 * sum(self.chunks)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def padding_ratio(self) -> float:
        """Padding rows over real tokens, all ranks together."""
        return self.world * self.local_len / self.total - 1.0

    @cached_property
    def offsets(self) -> list[int]:
        """Local row where sequence i starts (the same on every rank)."""
        out, o = [], 0
        for c in self.chunks:
            out.append(o)
            o += 2 * c
        return out

    def padded_positions(self, rank: int) -> torch.Tensor:
        """(T_l,) position of each local row inside its padded sequence (real when < L_i)."""
        self._check_rank(rank)
        parts = []
        for c in self.chunks:
            for k in (rank, 2 * self.world - 1 - rank):
                parts.append(torch.arange(k * c, (k + 1) * c))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def rope_positions(self, rank: int) -> torch.Tensor:
        """(T_l,) RoPE position of each local row: its padded position, after its prefix's length."""
        pos, seq = self.padded_positions(rank), self.sequence_ids()
        if not self.prefix:
            return pos
        shift = torch.tensor([self.lengths[p] if p >= 0 else 0 for p in self.prefix])
        return pos + shift[seq]

    def sequence_ids(self) -> torch.Tensor:
        """(T_l,) sequence of each local row (the same on every rank)."""
        return torch.repeat_interleave(torch.arange(len(self.chunks)), torch.tensor(self.chunks) * 2)

    def global_index(self, rank: int) -> torch.Tensor:
        """(T_l,) global packed position of each local row; −1 for padding rows."""
        pos, seq = self.padded_positions(rank), self.sequence_ids()
        lens, start = torch.tensor(self.lengths), torch.tensor(self.bounds[:-1])
        return torch.where(pos < lens[seq], start[seq] + pos, -1)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1, fill=0) -> torch.Tensor:
        """The local rows of a global tensor (size ``total`` along ``dim``); padding rows = ``fill``."""
        if x.shape[dim] != self.total:
            raise ValueError(f"shard: dim {dim} of {tuple(x.shape)} must be the row's {self.total} tokens")
        g = self.global_index(rank).to(x.device)
        picked = x.index_select(dim, g.clamp_min(0))
        shape = [1] * x.dim()
        shape[dim] = g.numel()
        return torch.where((g >= 0).view(shape), picked, torch.as_tensor(fill, dtype=x.dtype, device=x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of ``shard``: every rank's local rows (in rank order) -> the global tensor."""
        if len(parts) != self.world:
            raise ValueError(f"unshard needs one part per rank ({self.world}), got {len(parts)}")
        out = parts[0].new_zeros(*parts[0].shape[:dim], self.total, *parts[0].shape[dim + 1:])
        for r, p in enumerate(parts):
            g = self.global_index(r).to(p.device)
            keep = (g >= 0).nonzero()[:, 0]
            out.index_copy_(dim, g[keep], p.index_select(dim, keep))
        return out

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the context-parallel group of size {self.world}")


@dataclass(frozen=True)
class ZigzagShard:
    """One rank's view of a ``ZigzagPlan``; also the layout the model's forward receives
    (``total`` rows, RoPE ``positions()``), handed on to the ring attention as its mask."""
    plan: ZigzagPlan
    rank: int
    device: torch.device | str = "cpu"

    @property
    def total(self) -> int:
        return self.plan.local_len

    @cached_property
    def index(self) -> torch.Tensor:
        """(T_l,) global packed position of each local row, −1 for padding."""
        return self.plan.global_index(self.rank).to(self.device)

    def positions(self) -> torch.Tensor:
        """RoPE positions: as in the unsharded layout (padding rows continue counting)."""
        return self.plan.rope_positions(self.rank).to(self.device)
