"""GRPO: group advantages and the clipped policy-gradient loss, as pure functions.

Notation: a batch holds B completions (rows), each with T token slots; ``mask``
marks the real completion tokens (prompt and padding slots are 0). Log-probs are
of the emitted token at each slot, fp32.

Advantages (``group_advantages``), for groups of n consecutive completions of one
prompt with rewards r_1..r_n::

    b_i = mean_j r_j                      (default)
    b_i = mean_{j != i} r_j               (leave_one_out; = mean + (mean - r_i)/(n-1))
    s   = std_unbiased(r_1..r_n)          (Bessel: divide by n-1, as torch.std / verl / NeMo-RL)
    A_i = (r_i - b_i) / (s + eps)         (normalize_std)   or   A_i = r_i - b_i   (Dr.GRPO)

and A_i = 0 exactly when all n rewards of the group are equal (no signal; no
float residue). The leave-one-out scale is the same whole-group s.

Loss (``grpo_loss``), per unmasked token t of row i with advantage A_i::

    rho_t  = exp(logp_t - old_t)                                  (log-ratio clamped to ±20)
    pg_t   = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)   (DAPO clip-higher)
    w_t    = min(exp(old_t - rollout_t), is_cap), stop-gradient      (is_correction="token", TIS)
             1                                                       (is_correction=None)
    kl_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                (k3 estimate of KL(pi||ref))
    l_t    = w_t * pg_t + kl_coef * kl_t

    norm="token":    L = sum_{i,t} m_it l_t / global_tokens        (default: sum of mask here)
    norm="sequence": L = sum_i [ sum_t m_it l_t / |o_i| ] / global_sequences
                                                      (default: rows here with |o_i| > 0)

Passing the GLOBAL counts makes micro-batch losses add up to the full-batch loss
(and so do their gradients). A token is "clipped" when the clipped branch is
strictly the smaller one, i.e. its gradient is zero: A>0 and rho>1+eps_high
("high"), or A<0 and rho<1-eps_low ("low").

Train-inference mismatch (when ``rollout_logprobs`` is given). "Train" is
``old_logprobs``: the trainer's recompute under the same weights the rollout
engine sampled with, so any gap is numerics/refit error, not learning::

    token_mult_prob_error = mean_t exp(|old_t - rollout_t|)     (>= 1; 1 = perfect match)
    rollout_kl            = mean_t [exp(d_t) - d_t - 1],  d_t = old_t - rollout_t
                            (k3 estimate of KL(pi_rollout || pi_train); tokens are rollout samples)
    rollout_kl_k1         = mean_t (rollout_t - old_t)      (k1 estimate of the same KL)
    rollout_is_ratio      = mean_t exp(old_t - rollout_t)   (should sit at ~1)

All diagnostics are masked token means over THIS call's tokens (average them
across micro-batches yourself); they are detached 0-dim tensors, so building
them forces no host sync. Entropy bonuses, dual-clip, sequence-level ratios
(GSPO) and dynamic sampling are left out.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "group_advantages",
    "grpo_loss",
    "masked_mean",
    "masked_sum",
    "token_logprobs",
    "entropy_from_logits",
]

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps rho and its gradient finite (0 * inf = nan otherwise)


# ---------------------------------------------------------------------------- helpers

def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of x where mask is true; masked-out entries never contribute (even NaN/inf)."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of x over entries where mask is true; 0 where nothing is unmasked."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def token_logprobs(logits: Tensor, targets: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """log softmax(logits)[..., target] in fp32, without a full-vocab log-softmax tensor.

    logits (..., V), targets (...) -> (...). Uses logp = z_target - logsumexp(z): only the
    per-row logsumexp is materialised besides the input. ``chunk_size`` (rows) bounds the
    fp32 up-cast of low-precision logits to chunk_size x V at a time in the forward pass.
    """
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)  # (N,V)
    tgt = targets.reshape(-1, 1).long()  # (N,1)
    step = max(1, flat.shape[0] if chunk_size is None else chunk_size)
    out = []
    for s in range(0, flat.shape[0], step):
        z = flat[s : s + step]
        picked = z.gather(-1, tgt[s : s + step]).squeeze(-1).float()  # (n,)
        out.append(picked - torch.logsumexp(z.float(), dim=-1))
    if not out:  # no token (e.g. every sample of a step dropped): empty, still in the graph so backward runs
        return logits.new_zeros(targets.shape, dtype=torch.float32) + logits.float().sum() * 0
    return torch.cat(out).reshape(targets.shape)


def entropy_from_logits(logits: Tensor, mask: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 16
                        ) -> Tensor:
    """Masked token-mean entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of z = logits / temperature,
    in fp32.

    logits (B,T,V), mask (B,T) -> 0-dim. Only unmasked rows are evaluated, chunk_size rows at a
    time: each step's few temporaries (16 x V fp32: 3 MB for a 49 152-token vocabulary) stay in
    cache, where whole-batch ones (R x V, hundreds of MB, freshly allocated) cost ~5x more on CPU.
    Differentiable; with autograd on, in one chunk (each chunk's backward would fill a gradient
    of the logits' full size).
    """
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    rows = mask.reshape(-1).bool().nonzero().squeeze(-1)  # (n,) unmasked rows, no copy of the logits
    if rows.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    whole = chunk_size is None or (torch.is_grad_enabled() and logits.requires_grad)
    step = rows.shape[0] if whole else max(1, chunk_size)
    total = logits.new_zeros((), dtype=torch.float32)
    for s in range(0, rows.shape[0], step):
        z = flat.index_select(0, rows[s : s + step]).float() / temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        total = total + (lse.squeeze(-1) - (torch.exp(z - lse) * z).sum(-1)).sum()
    return total / rows.shape[0]


# ---------------------------------------------------------------------------- advantages

def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
    keep: Tensor | None = None,
) -> Tensor:
    """Per-completion advantages for groups of ``group_size`` consecutive rewards.

    rewards (N,) with N a multiple of n -> (N,) fp32. See the module docstring for the exact
    formula (Bessel std, leave-one-out baseline, equal-reward groups -> exactly 0).
    keep (N,) bool: the completions that have a reward (a reward function's None drops one): each group's
    statistics are those of its kept members alone, as if the group had only them, and a dropped one's
    advantage is 0 (the trainer also masks it out of the loss).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    n = int(group_size)
    if n < 1 or rewards.numel() % n:
        raise ValueError(f"group_size={n} must be >= 1 and divide len(rewards)={rewards.numel()}")
    if keep is not None and not bool(keep.all()):
        out = torch.zeros(rewards.shape, dtype=torch.float32)
        for g in range(0, rewards.numel(), n):
            idx = keep[g:g + n].nonzero().squeeze(-1) + g
            if idx.numel():
                out[idx] = group_advantages(rewards[idx], idx.numel(), normalize_std=normalize_std,
                                            leave_one_out=leave_one_out, eps=eps)
        return out
    r = rewards.float().reshape(-1, n)  # (G,n)
    mean = r.mean(-1, keepdim=True)
    if leave_one_out and n > 1:
        baseline = (r.sum(-1, keepdim=True) - r) / (n - 1)
    else:
        baseline = mean
    adv = r - baseline
    if normalize_std and n > 1:
        adv = adv / (r.std(-1, keepdim=True, correction=1) + eps)
    flat = r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)  # (G,1) zero-variance groups
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


# ---------------------------------------------------------------------------- loss

def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    norm: Literal["token", "sequence"] = "token",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    rollout_logprobs: Tensor | None = None,
    is_correction: Literal["token"] | None = None,
    is_cap: float = 2.0,
    global_tokens: int | float | Tensor | None = None,
    global_sequences: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO surrogate (+ optional k3 KL, + optional TIS correction); see module docstring.

    logprobs (B,T) carry the gradient; old_logprobs / ref_logprobs / rollout_logprobs (B,T) and
    advantages (B,) are treated as constants. Returns (loss, metrics) where loss is 0-dim and
    metrics holds detached 0-dim tensors: loss, pg_loss, clip_frac, clip_frac_low,
    clip_frac_high, ratio_mean, ratio_min, ratio_max, num_tokens, and when given kl_ref;
    token_mult_prob_error, rollout_kl, rollout_kl_k1, rollout_is_ratio; is_weight_mean,
    is_capped_frac.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, norm=norm, ref_logprobs=ref_logprobs,
                  kl_coef=kl_coef, rollout_logprobs=rollout_logprobs, is_correction=is_correction)
    m = mask.bool()
    logp = logprobs.float()
    old = old_logprobs.detach().float()
    A = advantages.detach().float().unsqueeze(-1)  # (B,1)

    # -- clipped surrogate, per token (B,T)
    ratio = torch.exp((logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_tok = -torch.minimum(ratio * A, clipped * A)

    metrics: dict[str, Tensor] = {}
    # -- truncated importance sampling against the rollout engine's sampling distribution
    if rollout_logprobs is not None:
        pg_tok = _rollout_mismatch(pg_tok, old, rollout_logprobs.detach().float(), m, is_correction, is_cap, metrics)

    # -- k3 KL to the reference policy
    per_tok = pg_tok
    if ref_logprobs is not None:
        lr = ref_logprobs.detach().float() - logp
        kl_tok = torch.exp(lr) - lr - 1.0
        metrics["kl_ref"] = masked_mean(kl_tok.detach(), m)
        if kl_coef != 0.0:
            per_tok = per_tok + kl_coef * kl_tok

    # -- normalisation
    def reduce(x: Tensor) -> Tensor:
        if norm == "token":
            denom = m.sum().clamp_min(1) if global_tokens is None else global_tokens
            return masked_sum(x, m) / denom
        lens = m.sum(-1)  # (B,)
        per_seq = masked_sum(x, m, dim=-1) / lens.clamp_min(1)
        denom = (lens > 0).sum().clamp_min(1) if global_sequences is None else global_sequences
        return per_seq.sum() / denom

    loss = reduce(per_tok)

    with torch.no_grad():
        hi = m & (A > 0) & (ratio > 1.0 + eps_high)
        lo = m & (A < 0) & (ratio < 1.0 - eps_low)
        metrics.update(
            loss=loss.detach(),
            pg_loss=reduce(pg_tok).detach(),
            clip_frac_high=masked_mean(hi.float(), m),
            clip_frac_low=masked_mean(lo.float(), m),
            clip_frac=masked_mean((hi | lo).float(), m),
            ratio_mean=masked_mean(ratio, m),
            ratio_min=torch.where(m, ratio, torch.inf).amin(),  # +inf if no token
            ratio_max=torch.where(m, ratio, -torch.inf).amax(),  # -inf if no token
            num_tokens=m.sum().float(),
        )
    return loss, metrics


def _check_inputs(logprobs, old_logprobs, advantages, mask, *, norm, ref_logprobs, kl_coef, rollout_logprobs,
                  is_correction) -> None:
    B, T = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask),
                    ("ref_logprobs", ref_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if t is not None and tuple(t.shape) != (B, T):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logprobs' {(B, T)}")
    if tuple(advantages.shape) != (B,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {(B,)}")
    if norm not in ("token", "sequence"):
        raise ValueError(f"norm must be 'token' or 'sequence', got {norm!r}")
    if is_correction not in (None, "token"):
        raise ValueError(f"is_correction must be None or 'token', got {is_correction!r}")
    if is_correction is not None and rollout_logprobs is None:
        raise ValueError("is_correction='token' needs rollout_logprobs")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")


def _rollout_mismatch(pg_tok: Tensor, old: Tensor, roll: Tensor, m: Tensor, is_correction, is_cap: float,
                      metrics: dict) -> Tensor:
    """Mismatch metrics between the trainer's and the rollout engine's logprobs of the sampled tokens
    (into ``metrics``), and the per-token surrogate with the truncated IS weight when corrected."""
    d = old - roll  # log(pi_train / pi_rollout) at the sampled tokens
    metrics["token_mult_prob_error"] = masked_mean(torch.exp(d.abs()), m)
    metrics["rollout_kl"] = masked_mean(torch.exp(d) - d - 1.0, m)
    metrics["rollout_kl_k1"] = masked_mean(-d, m)
    metrics["rollout_is_ratio"] = masked_mean(torch.exp(d), m)
    if is_correction == "token":
        raw = torch.exp(d)
        w = raw.clamp(max=is_cap)
        metrics["is_weight_mean"] = masked_mean(w, m)
        metrics["is_capped_frac"] = masked_mean((raw > is_cap).float(), m)
        return w * pg_tok
    return pg_tok
