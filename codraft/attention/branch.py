"""Branch attention: branch queries over a main-sequence prefix plus their own local branch keys.

Draft training hangs short *branches* off a main (packed) sequence of length T. A branch n has an
anchor position a_n in the main sequence and G slots, each with a query, a key and a value. Slot i
of branch n attends to

  (m) main keys s of the same packed sequence with s ≤ a_n (``include_anchor=True``) or s < a_n
      (``include_anchor=False``), and
  (b) keys of its own branch: slots 0..i (``local="diagonal"``) or all G slots (``local="block"``).

The two drafts used here:

* EAGLE-3 training-time test (TTT): one branch per main row t (anchor t, so N = T), slot j = TTT
  step j, ``local="diagonal"``, ``include_anchor=True``: step j at row t sees main keys ≤ t plus the
  same row's steps 0..j. When steps are unrolled one at a time, pass the current step's queries
  only: with Gq < Gk query slots, query i is slot Gk − Gq + i (bottom-right aligned), so Gq = 1
  attends all Gk cached steps of its row.
* DFlash / DSpark: N blocks of γ slots, ``local="block"``, ``include_anchor=False``: a block sees the
  context strictly before its anchor and its own γ slots bidirectionally.

Both parts are computed separately, each as (O, ℓ) with ℓ = log Σ exp(scores), and merged exactly
with ``merge_lse``. Gradients are autograd through both parts and the merge, which is exact. The
main part of a row can be empty (a DFlash anchor at the first token of a sequence, an anchor in
the padding tail); it gives ℓ = −inf and is merged without NaN. The branch part is never empty.

Packing: main keys are packed sequences split by ``cu_seqlens`` (shared by the batch); a branch
only sees its anchor's sequence, and keys at or after cu_seqlens[-1] (padding) are never seen.
Anchors are packed indices into the main sequence, (N,) or (B,N), in [0, T).

Cost: with packed sequences and anchors shared by the batch (the drafts' training case), the main
part runs one masked attention per sequence: its branches against its own keys. Otherwise it is
one masked attention of all N·Gq branch queries against the T main keys (scores
(B,H,N,Gq,T), mask built from the anchors, no loop over queries). The local part is a
batched Gq×Gk attention inside each branch (for the diagonal, a few elementwise q·k products per
row). ``dense_branch_reference`` builds the full mask over [main keys ; branch keys] and runs
plain softmax attention; it is the test oracle.

Not here: fused kernels, sliding windows, the context-parallel ring (it reuses ``merge_lse``).
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from codraft.attention.dense import sdpa
from codraft.attention.merge import compute_dtype, group_queries, merge_lse, softmax_with_lse

Local = Literal["diagonal", "block"]


def _anchors(anchors: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """(B|1, N) int64 anchors; None means branch n hangs off main row n."""
    if anchors is None:
        return torch.arange(n, device=device)[None]
    a = anchors.to(device=device, dtype=torch.long)
    a = a[None] if a.dim() == 1 else a
    if a.dim() != 2 or a.shape[1] != n:
        raise ValueError(f"anchors must be (N,) or (B,N) with N={n}, got {tuple(anchors.shape)}")
    return a


def branch_main_mask(
    anchors: torch.Tensor, t: int, *, include_anchor: bool, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """(B|1, N, T) bool: may branch n attend main key s. anchors (N,) or (B,N) packed indices."""
    a = anchors[None] if anchors.dim() == 1 else anchors  # (B|1,N)
    s = torch.arange(t, device=a.device)  # (T,)
    allowed = s <= a[..., None] if include_anchor else s < a[..., None]  # (B|1,N,T)
    if cu_seqlens is None:
        return allowed
    cu = cu_seqlens.to(device=a.device, dtype=a.dtype)
    seq = torch.searchsorted(cu[1:], a.contiguous(), right=True)  # (B|1,N) sequence of each anchor; padding → last
    start = cu[seq]  # padding anchors get start = cu[-1]: nothing below is kept
    return allowed & (s >= start[..., None]) & (s < cu[-1])


def branch_main_part(
    q: torch.Tensor,
    k_main: torch.Tensor,
    v_main: torch.Tensor,
    anchors: torch.Tensor | None,
    *,
    include_anchor: bool,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (m): branch queries q (B,H,N,Gq,D) over main k/v (B,Hkv,T,D) → O (B,H,N,Gq,D), LSE (B,H,N,Gq)."""
    b, h, n, gq, d = q.shape
    hkv, t = k_main.shape[1], k_main.shape[2]
    dt = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    a = _anchors(anchors, n, q.device)
    if cu_seqlens is not None and a.shape[0] == 1 and cu_seqlens.numel() > 2:
        return _main_part_per_sequence(q, k_main, v_main, a[0], include_anchor, cu_seqlens, scale)
    mask = branch_main_mask(a, t, include_anchor=include_anchor, cu_seqlens=cu_seqlens)  # (B|1,N,T)
    qg = group_queries(q.to(dt), hkv)  # (B,Hkv,g,N,Gq,D)
    scores = torch.einsum("bkgnid,bktd->bkgnit", qg, k_main.to(dt)) * scale  # (B,Hkv,g,N,Gq,T)
    p, lse = softmax_with_lse(scores, mask[:, None, None, :, None, :])
    o = torch.einsum("bkgnit,bktd->bkgnid", p, v_main.to(dt))  # (B,Hkv,g,N,Gq,D)
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)


def _main_part_per_sequence(q, k_main, v_main, anchors, include_anchor, cu_seqlens, scale):
    """``branch_main_part`` for anchors shared by the batch, one packed sequence at a time.

    A branch only sees its anchor's sequence, so the dense form spends almost all of its
    (N·Gq × T) scores on other sequences' keys: with 32 sequences, ~97 %. Here the branches are
    grouped by sequence and each group attends to its own keys only. Branches anchored in the
    padding tail see nothing: O = 0, LSE = −inf, as in the dense form.
    """
    b, h, n, gq, d = q.shape
    hkv = k_main.shape[1]
    dt = compute_dtype(q.dtype)
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    seq = torch.searchsorted(cu[1:], anchors, right=True)  # (N,) sequence per branch; padding → len(cu) - 1
    order = torch.argsort(seq, stable=True)
    counts = torch.bincount(seq, minlength=cu.numel()).tolist()
    bounds = cu.tolist()
    qg = group_queries(q.to(dt), hkv)  # (B,Hkv,g,N,Gq,D)
    outs, lses, start = [], [], 0
    for i, c in enumerate(counts):
        if c == 0:
            continue
        rows = order[start:start + c]
        start += c
        if i == len(bounds) - 1:  # padding anchors
            outs.append(qg.new_zeros(b, hkv, h // hkv, c, gq, d))
            lses.append(qg.new_full((b, hkv, h // hkv, c, gq), float("-inf")))
            continue
        lo, hi = bounds[i], bounds[i + 1]
        s = torch.arange(lo, hi, device=q.device)
        a = anchors[rows, None]
        mask = s <= a if include_anchor else s < a  # (c, L)
        scores = torch.einsum("bkgnid,bktd->bkgnit", qg[:, :, :, rows], k_main[:, :, lo:hi].to(dt)) * scale
        p, lse = softmax_with_lse(scores, mask[None, None, None, :, None, :])
        outs.append(torch.einsum("bkgnit,bktd->bkgnid", p, v_main[:, :, lo:hi].to(dt)))
        lses.append(lse)
    back = torch.argsort(order)  # grouped position of each original branch
    o = torch.cat(outs, dim=3)[:, :, :, back]
    lse = torch.cat(lses, dim=3)[:, :, :, back]
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)


def local_branch_mask(gq: int, gk: int, local: Local, device: torch.device | None = None) -> torch.Tensor | None:
    """(Gq, Gk) bool within one branch, or None when every slot sees every slot ("block")."""
    if local == "block":
        if gq != gk:
            raise ValueError(f'local="block" needs as many query slots as key slots, got Gq={gq}, Gk={gk}')
        return None
    if local != "diagonal":
        raise ValueError(f'local must be "diagonal" or "block", got {local!r}')
    if gq > gk:
        raise ValueError(f"diagonal branch has more query slots than key slots: Gq={gq} > Gk={gk}")
    slot = torch.arange(gq, device=device) + (gk - gq)  # (Gq,) slot index of each query
    return torch.arange(gk, device=device)[None, :] <= slot[:, None]


def branch_local_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, local: Local, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (b): q (B,H,N,Gq,D) over its own branch's k/v (B,Hkv,N,Gk,D) → O (B,H,N,Gq,D), LSE (B,H,N,Gq)."""
    b, h, n, gq, d = q.shape
    hkv, gk = k.shape[1], k.shape[3]
    dt = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = local_branch_mask(gq, gk, local, q.device)  # (Gq,Gk) or None
    qg = group_queries(q.to(dt), hkv)  # (B,Hkv,g,N,Gq,D)
    scores = torch.einsum("bkgnid,bknjd->bkgnij", qg, k.to(dt)) * scale  # (B,Hkv,g,N,Gq,Gk)
    p, lse = softmax_with_lse(scores, mask)
    o = torch.einsum("bkgnij,bknjd->bkgnid", p, v.to(dt))  # (B,Hkv,g,N,Gq,D)
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)


def _check(q, k, v, k_main, v_main) -> None:
    if q.dim() != 5 or k.dim() != 5 or v.shape != k.shape:
        raise ValueError(
            f"branch q must be (B,H,N,Gq,D) and k/v (B,Hkv,N,Gk,D); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k_main.dim() != 4 or v_main.shape != k_main.shape:
        raise ValueError(f"main k/v must be (B,Hkv,T,D); got {tuple(k_main.shape)}, {tuple(v_main.shape)}")
    b, _, n, _, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[4] != d or k_main.shape[1] != k.shape[1]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, branch k {tuple(k.shape)}, main k {tuple(k_main.shape)}"
        )
    if k_main.shape[0] != b or k_main.shape[3] != d:
        raise ValueError(f"main k {tuple(k_main.shape)} does not match q {tuple(q.shape)}")


def branch_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_main: torch.Tensor,
    v_main: torch.Tensor,
    anchors: torch.Tensor | None = None,
    *,
    local: Local,
    include_anchor: bool,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Main part and branch part, merged: O (B,H,N,Gq,D) and LSE (B,H,N,Gq) in compute dtype (≥ fp32).

    q (B,H,N,Gq,D) branch queries; k, v (B,Hkv,N,Gk,D) branch keys/values; k_main, v_main
    (B,Hkv,T,D); anchors (N,) or (B,N) packed main indices, None = arange(N) (needs N == T).
    """
    _check(q, k, v, k_main, v_main)
    if anchors is None and q.shape[2] != k_main.shape[2]:
        raise ValueError(f"anchors=None needs one branch per main row, got N={q.shape[2]}, T={k_main.shape[2]}")
    om, lm = branch_main_part(
        q, k_main, v_main, anchors, include_anchor=include_anchor, cu_seqlens=cu_seqlens, scale=scale
    )
    ob, lb = branch_local_part(q, k, v, local=local, scale=scale)
    return merge_lse(om, lm, ob, lb)


def branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_main: torch.Tensor,
    v_main: torch.Tensor,
    anchors: torch.Tensor | None = None,
    *,
    local: Local,
    include_anchor: bool,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``branch_attention_with_lse`` without the LSE, cast back to q.dtype: (B,H,N,Gq,D)."""
    o, _ = branch_attention_with_lse(
        q, k, v, k_main, v_main, anchors,
        local=local, include_anchor=include_anchor, cu_seqlens=cu_seqlens, scale=scale,
    )
    return o.to(q.dtype)


# ---- dense reference ------------------------------------------------------------------------


def dense_branch_mask(
    anchors: torch.Tensor | None,
    t: int,
    n: int,
    gq: int,
    gk: int,
    *,
    local: Local,
    include_anchor: bool,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """(B|1, 1, N·Gq, T + N·Gk) bool over [main keys ; branch keys flattened branch-major]."""
    a = torch.arange(n, device=device)[None] if anchors is None else anchors.to(device, torch.long)
    a = a[None] if a.dim() == 1 else a  # (B|1,N)
    s = torch.arange(t, device=device)  # main key positions
    if cu_seqlens is None:
        seq_of = torch.zeros(t, dtype=torch.long, device=device)
        valid = torch.ones(t, dtype=torch.bool, device=device)
    else:
        cu = cu_seqlens.to(device, torch.long)
        seq_of = (s[None, :] >= cu[1:-1, None]).sum(0)  # sequence id of every main token
        valid = s < cu[-1]
    qi = torch.arange(n * gq, device=device)
    q_branch, q_slot = qi // gq, qi % gq + (gk - gq)  # (N·Gq,)
    q_anchor = a[:, q_branch]  # (B|1,N·Gq)
    before = s <= q_anchor[..., None] if include_anchor else s < q_anchor[..., None]
    same_seq = seq_of[q_anchor][..., None] == seq_of  # (B|1,N·Gq,T)
    main_ok = before & same_seq & valid & valid[q_anchor][..., None]
    ki = torch.arange(n * gk, device=device)
    k_branch, k_slot = ki // gk, ki % gk
    branch_ok = q_branch[:, None] == k_branch[None, :]  # (N·Gq,N·Gk)
    if local == "diagonal":
        branch_ok = branch_ok & (k_slot[None, :] <= q_slot[:, None])
    branch_ok = branch_ok.expand(main_ok.shape[0], -1, -1)
    return torch.cat([main_ok, branch_ok], dim=-1)[:, None]


def dense_branch_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_main: torch.Tensor,
    v_main: torch.Tensor,
    anchors: torch.Tensor | None = None,
    *,
    local: Local,
    include_anchor: bool,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``branch_attention_with_lse``, by one dense masked softmax over all keys."""
    b, h, n, gq, d = q.shape
    hkv, t, gk = k_main.shape[1], k_main.shape[2], k.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = dense_branch_mask(
        anchors, t, n, gq, gk, local=local, include_anchor=include_anchor, cu_seqlens=cu_seqlens, device=q.device
    )  # (B|1,1,N·Gq,T+N·Gk)
    qf = q.reshape(b, h, n * gq, d)  # (B,H,N·Gq,D)
    kf = torch.cat([k_main, k.reshape(b, hkv, n * gk, d)], dim=2)  # (B,Hkv,T+N·Gk,D)
    vf = torch.cat([v_main, v.reshape(b, hkv, n * gk, d)], dim=2)
    o = sdpa(qf * (scale * math.sqrt(d)), kf, vf, mask)  # sdpa scales by 1/sqrt(D)
    scores = qf @ kf.repeat_interleave(h // hkv, dim=1).transpose(-1, -2) * scale
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)
