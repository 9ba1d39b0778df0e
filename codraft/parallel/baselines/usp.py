"""USP baseline (``usp_attention``, ``UspPlan``): Ulysses degree U, ring degree R = C/U, ranks
ρ·U + υ (Ulysses groups are contiguous ranks, ring groups strided, as yunchang's
``use_ulysses_low``). Each sequence is padded to a multiple of 2C and cut into 2R zigzag chunks,
each split into U contiguous pieces; rank (ρ, υ) holds piece υ of chunks ρ and 2R−1−ρ. An
all-to-all over the Ulysses group turns (local rows, all heads) into (the ring rank's rows, H/U
heads), the rows are reordered into the zigzag layout of the ring group, the zigzag ring runs
there (``ring_attention`` on a ring subgroup; a ring of one rank when R = 1 is plain local causal
attention), and the inverse all-to-all brings O and ℓ back. Heads must split over U: the KV
heads are padded with zeros to a multiple of U and the query heads with them, keeping the
query/KV ratio (padded query head h reads padded KV head h // ratio), as yunchang's callers do
(yunchang itself only asserts the divisibility); padded heads cost compute and are cut off at
the end. Default **U = C** (pure Ulysses, R = 1: no ring at all, the configuration USP users
pick when the heads allow); at C = 4 with the tiny policy's 2 KV heads that means padding KV
heads to 4 and query heads to 8, i.e. twice the attention work per rank. ``UspPlan.of(...,
ulysses=u)`` picks another split (u = 2 at C = 4: two KV heads split exactly, a zigzag ring of 2).
gloo has ``all_to_all_single`` (checked on torch 2.13); if a build lacks it, an all-gather of
the input and a slice replaces it (U× the bytes; said once on stderr).

Contract: the package docstring (``codraft.parallel.baselines``). ``comm_bytes`` and
``reset_comm_bytes`` live here because they also cover the ring subgroups USP creates."""
from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from codraft.parallel.baselines.common import _check, _count, _scale
from codraft.parallel.baselines.plans import UspShard
from codraft.parallel.comm import Group
from codraft.parallel.ring import ring_attention

_A2A_FALLBACK: list[bool] = []  # [True] once all_to_all_single was found missing


def _all_to_all(x: torch.Tensor, comm: Group) -> torch.Tensor:
    """x (U, ...) contiguous: piece j goes to rank j; returns (U, ...) with piece j from rank j."""
    out = torch.empty_like(x)
    if not _A2A_FALLBACK:
        try:
            dist.all_to_all_single(out, x, group=comm.group)
            _count(comm, (comm.size - 1) * x.numel() * x.element_size() // comm.size)
            return out
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            _A2A_FALLBACK.append(True)
            print(f"codraft: all_to_all_single unavailable on this backend ({e}); USP uses all_gather + slice",
                  file=sys.stderr)
    buf = x.new_empty(comm.size, *x.shape)
    dist.all_gather(list(buf.unbind(0)), x, group=comm.group)
    _count(comm, (comm.size - 1) * x.numel() * x.element_size())
    return buf[:, comm.rank].contiguous()


def _seq_to_heads(x: torch.Tensor, comm: Group) -> torch.Tensor:
    """(B,H,T,*) with all heads of T local rows -> (B,H/U,U·T,*): H/U heads of the group's rows."""
    u = comm.size
    if u == 1:
        return x
    b, h, t = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, u, h // u, t, *rest).transpose(0, 1).contiguous()  # (U,B,H/U,T,*)
    got = _all_to_all(send, comm)  # (U: source rank, B, H/U, T, *)
    return got.permute(1, 2, 0, *range(3, got.dim())).reshape(b, h // u, u * t, *rest)


def _heads_to_seq(x: torch.Tensor, comm: Group) -> torch.Tensor:
    """Inverse of ``_seq_to_heads``: (B,H/U,U·T,*) -> (B,H,T,*)."""
    u = comm.size
    if u == 1:
        return x
    b, hu, ut = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, hu, u, ut // u, *rest).permute(2, 0, 1, *range(3, x.dim() + 1)).contiguous()  # (U,B,H/U,T,*)
    got = _all_to_all(send, comm)  # (U: source rank = head group, B, H/U, T, *)
    return got.transpose(0, 1).reshape(b, hu * u, ut // u, *rest)


class _Relayout(torch.autograd.Function):
    """An all-to-all layout change (``there``) whose gradient is the inverse change (``back``)."""

    @staticmethod
    def forward(ctx, x, comm, there, back):
        ctx.comm, ctx.back = comm, back
        return there(x, comm)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g.contiguous(), ctx.comm), None, None, None


_USP_GROUPS: dict = {}  # (id(group), size, U) -> (Ulysses Group, ring Group) made by dist.new_group


def _usp_groups(comm: Group, u: int) -> tuple[Group, Group]:
    """(Ulysses group, ring group) of this rank. U = C or U = 1 reuse ``comm`` (the other one is a
    group of one, which never communicates); otherwise the subgroups are created once per
    (group, U), by all ranks together (every rank creates every group, in the same order)."""
    c = comm.size
    if u == c:
        return comm, Group(None, 0, 1, comm.timeout)
    if u == 1:
        return Group(None, 0, 1, comm.timeout), comm
    key = (id(comm.group), c, u)
    if key not in _USP_GROUPS:
        r, td = c // u, datetime.timedelta(seconds=comm.timeout)  # (gloo's default would be 30 min)
        ug = rg = None
        for rho in range(r):
            g = dist.new_group([comm.global_rank(rho * u + j) for j in range(u)], timeout=td)
            if comm.rank // u == rho:
                ug = Group(g, comm.rank % u, u, comm.timeout)
        for j in range(u):
            g = dist.new_group([comm.global_rank(rho * u + j) for rho in range(r)], timeout=td)
            if comm.rank % u == j:
                rg = Group(g, comm.rank // u, r, comm.timeout)
        _USP_GROUPS[key] = (ug, rg)
    return _USP_GROUPS[key]


def _subgroups(comm: Group) -> list[Group]:
    return [g for key, groups in _USP_GROUPS.items() if key[:2] == (id(comm.group), comm.size) for g in groups]


def comm_bytes(comm: Group) -> int:
    """Bytes this rank sent through ``comm`` and the USP subgroups made from its group."""
    return comm.sent_bytes + sum(g.sent_bytes for g in _subgroups(comm))


def reset_comm_bytes(comm: Group) -> None:
    for g in [comm, *_subgroups(comm)]:
        g.sent_bytes = 0


def _pad_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[1] == n:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:])], dim=1)


def usp_heads(h: int, hkv: int, u: int) -> tuple[int, int]:
    """(query heads, KV heads) after padding for Ulysses degree u: KV heads up to a multiple of u,
    query heads with them at the same ratio."""
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    hkv_p = -(-hkv // u) * u
    return hkv_p * (h // hkv), hkv_p


def usp_attention(q, k, v, shard: UspShard, comm: Group, scale: float | None = None):
    """Causal attention by USP (Ulysses all-to-all over heads + zigzag ring): module docstring."""
    _check(shard, comm, k.shape[2], UspShard)
    plan = shard.plan
    ucomm, rcomm = _usp_groups(comm, plan.ulysses)
    h, hkv = q.shape[1], k.shape[1]
    hp, hkvp = usp_heads(h, hkv, plan.ulysses)
    scale = _scale(q, scale)
    order = shard.ring_order
    back = torch.argsort(order)
    qa, ka, va = (_Relayout.apply(_pad_heads(x, n), ucomm, _seq_to_heads, _heads_to_seq).index_select(2, order)
                  for x, n in ((q, hp), (k, hkvp), (v, hkvp)))
    o, lse = ring_attention(qa, ka, va, shard.ring_shard, rcomm, scale)
    o = _Relayout.apply(o.index_select(2, back), ucomm, _heads_to_seq, _seq_to_heads)
    lse = _Relayout.apply(lse.index_select(2, back), ucomm, _heads_to_seq, _seq_to_heads)
    return o[:, :h], lse[:, :h]
