"""One attention block of a ring step, forward and backward by hand, with its log-sum-exp.

A ring computes attention as a sum over key blocks that arrive one at a time, so it needs what
flash attention's kernels give: a block's (O, ℓ) for the merge, and a backward that takes the
*final* merged O and ℓ (every block's softmax weight is exp(s − ℓ_final)). In fp32, with the
upstream gradient of ℓ included (a branch's main part is merged again with its local part):

    P = exp(S − ℓ),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ⊙ (dP − D + dℓ),  D = rowsum(dO ⊙ O)
    dQ = scale·dS·K,  dK = scale·dSᵀ·Q

Grouped-query heads read KV head h // (H/Hkv); dK/dV sum over the group. ``mask`` (Tq, Tk)
bool, True = attend, or None = all; ``causal`` = the square lower triangle. Rows with nothing to
attend give ℓ = −inf, O = 0, zero gradients.

Two implementations. On CPU, unmasked and causal blocks run PyTorch's flash kernel, which
returns ℓ and whose backward takes the final O and ℓ: ~10× faster than the explicit form at 4K
tokens. Its backward has no ℓ input; the dℓ term is folded in through one extra head-dim
column (q, k, v padded with 0, dO with 1, O with −dℓ, so that its D = rowsum(dO ⊙ O) becomes
D − dℓ while the scores and dP stay as they were; nothing cancels, so no precision is lost). Masked blocks (branches) and other devices take the explicit
form, with queries in chunks so that no more than ``MAX_SCORES`` scores are alive.
"""
from __future__ import annotations

import torch

from codraft.attention.merge import group_queries

MAX_SCORES = 1 << 24  # scores per query chunk (64 MB in fp32)


def _rows_per_chunk(h: int, tk: int) -> int:
    return max(1, MAX_SCORES // max(1, h * tk))


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return _FLASH is not None and mask is None and q.device.type == "cpu" and q.shape[2] > 0


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B,Hkv,T,D) -> (B,H,T,D) fp32, contiguous: KV head h // (H/Hkv) for query head h."""
    return x.float().repeat_interleave(h // x.shape[1], dim=1).contiguous()


def _dense(x: torch.Tensor) -> torch.Tensor:
    """fp32 and contiguous: the flash kernel's backward misreads strided views (measured)."""
    return x.float().contiguous()


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,H,Tq,D), k/v (B,Hkv,Tk,D) -> O (B,H,Tq,D) fp32, ℓ (B,H,Tq) fp32."""
    b, h, tq, d = q.shape
    if _flash(q, mask):
        o, lse = _FLASH(_dense(q), _heads(k, h), _heads(v, h), 0.0, causal, scale=scale)
        return o, lse
    if causal:
        mask = torch.ones(tq, k.shape[2], dtype=torch.bool, device=q.device).tril()
    hkv, tk = k.shape[1], k.shape[2]
    kf, vf = k.float(), v.float()
    o = q.new_zeros(b, h, tq, d, dtype=torch.float32)
    lse = q.new_full((b, h, tq), float("-inf"), dtype=torch.float32)
    step = _rows_per_chunk(h, tk)
    for i in range(0, tq, step):
        qg = group_queries(q[:, :, i:i + step].float(), hkv)  # (B,Hkv,g,n,D)
        s = torch.einsum("bkgnd,bktd->bkgnt", qg, kf) * scale
        if mask is not None:
            s = s.masked_fill(~mask[i:i + step], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        tot = e.sum(-1, keepdim=True)
        n = s.shape[3]
        lse[:, :, i:i + n] = torch.where(tot > 0, torch.log(tot) + m, float("-inf")).reshape(b, h, n)
        o[:, :, i:i + n] = torch.einsum("bkgnt,bktd->bkgnd", e / tot.clamp_min(1e-38), vf).reshape(b, h, n, d)
    return o, lse


def block_backward(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   delta: torch.Tensor | None = None, causal: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final O, ℓ (B,H,Tq[,D]) and their upstream grads.

    Returns dQ (B,H,Tq,D), dK, dV (B,Hkv,Tk,D), all fp32. ``delta`` = rowsum(dO ⊙ O) may be
    passed in when the caller computes it once for several blocks (explicit form only).
    """
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if _flash(q, mask):
        return _flash_backward(do, dlse, q, k, v, o, lse, scale, causal)
    if causal:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
    kf, vf = k.float(), v.float()
    if delta is None:
        delta = (do.float() * o).sum(-1)
    dq = torch.zeros(b, h, tq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hkv, tk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    finite = torch.isfinite(lse)
    lse_safe = torch.where(finite, lse, torch.zeros_like(lse))
    step = _rows_per_chunk(h, tk)
    for i in range(0, tq, step):
        sl = slice(i, i + step)
        qg = group_queries(q[:, :, sl].float(), hkv)  # (B,Hkv,g,n,D)
        n = qg.shape[3]
        s = torch.einsum("bkgnd,bktd->bkgnt", qg, kf) * scale
        p = torch.exp(s - group_queries(lse_safe[:, :, sl], hkv)[..., None])
        keep = group_queries(finite[:, :, sl], hkv)[..., None]
        if mask is not None:
            keep = keep & mask[sl]
        p = torch.where(keep, p, torch.zeros((), dtype=p.dtype, device=p.device))
        dog = group_queries(do[:, :, sl].float(), hkv)  # (B,Hkv,g,n,D)
        dv += torch.einsum("bkgnt,bkgnd->bktd", p, dog)
        dp = torch.einsum("bkgnd,bktd->bkgnt", dog, vf)
        row = -group_queries(delta[:, :, sl], hkv)
        if dlse is not None:
            row = row + group_queries(dlse[:, :, sl].float(), hkv)
        ds = p * (dp + row[..., None]) * scale
        dq[:, :, sl] = torch.einsum("bkgnt,bktd->bkgnd", ds, kf).reshape(b, h, n, d)
        dk += torch.einsum("bkgnt,bkgnd->bktd", ds, qg)
    return dq, dk, dv


def _flash_backward(do, dlse, q, k, v, o, lse, scale, causal):
    h, hkv = q.shape[1], k.shape[1]
    q, k, v, do, o, lse = _dense(q), _heads(k, h), _heads(v, h), _dense(do), _dense(o), _dense(lse)
    if dlse is not None:  # the extra column (module doc): D' = rowsum(dO ⊙ O) − dℓ
        pad = lambda x: torch.cat([x, x.new_zeros(*x.shape[:3], 1)], -1)  # noqa: E731
        q, k, v = pad(q), pad(k), pad(v)
        do, o = torch.cat([do, do.new_ones(*do.shape[:3], 1)], -1), torch.cat([o, -dlse.float()[..., None]], -1)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, scale=scale)
    d = q.shape[-1] - (dlse is not None)
    g = h // hkv  # query heads that share a KV head: their dK/dV add up
    fold = lambda x: x[..., :d].reshape(x.shape[0], hkv, g, x.shape[2], d).sum(2)  # noqa: E731
    return dq[..., :d], fold(dk), fold(dv)
