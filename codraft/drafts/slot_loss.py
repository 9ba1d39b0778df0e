"""A block draft's per-slot losses against the target, with a hand-written backward.

Per slot row: z (K,) the draft's logits, q = softmax(z); p (K,) the teacher's probabilities of the
same K tokens (with a draft vocabulary of K < V tokens, Σ p ≤ 1: the rest is mass the draft cannot
propose); the label y:

    CE = −log q_y                              ∂CE/∂z = q − onehot(y)
    L1 = Σ |q − p| (+ 1 − Σ p)                 ∂L1/∂z = q ⊙ (s − Σ q·s),  s = sign(q − p)

(the term 1 − Σ p does not depend on z). Autograd through log_softmax, exp, the difference, abs
and the sums walks (rows, K) temporaries about fifteen times and keeps half a dozen alive; here
the forward keeps q and s and the backward is three passes. At sign 0 (q = p exactly) the
gradient takes 0, as torch's abs does.
Not here: how the slots are weighted and masked (the draft's ``loss``).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class _SlotLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, labels, teacher_logp, outside: bool):
        logp = z.to(torch.promote_types(z.dtype, torch.float32)).log_softmax(-1)  # fp32, or fp64 (gradcheck)
        ce = -logp.gather(-1, labels[..., None]).squeeze(-1)
        q = logp.exp_()
        p = teacher_logp.to(logp.dtype).exp()
        rest = (1 - p.sum(-1)).clamp_min(0) if outside else None
        d = p.neg_().add_(q)  # q − p, in p's buffer
        l1 = torch.linalg.vector_norm(d, 1, -1)
        if rest is not None:
            l1 = l1 + rest
        ctx.save_for_backward(q, d.sign_(), labels)
        ctx.z_dtype = z.dtype
        return ce, l1

    @staticmethod
    @once_differentiable
    def backward(ctx, g_ce, g_l1):
        q, s, labels = ctx.saved_tensors
        grad = q * s
        grad.addcmul_(q, grad.sum(-1, keepdim=True), value=-1).mul_(g_l1[..., None])  # g_l1 · ∂L1/∂z
        grad.addcmul_(q, g_ce[..., None]).scatter_add_(-1, labels[..., None], -g_ce[..., None])  # + g_ce · ∂CE/∂z
        return grad.to(ctx.z_dtype), None, None, None


def slot_losses(z: torch.Tensor, labels: torch.Tensor, teacher_logp: torch.Tensor,
                outside: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """z (…,K) draft logits, labels (…) indices into K, teacher_logp (…,K) the teacher's log-probabilities
    of the K tokens (no gradient) -> (CE (…), L1 (…)) in fp32 (fp64 for fp64 z); ``outside``: add the
    teacher's mass outside the K tokens to L1 (a draft vocabulary smaller than the target's)."""
    return _SlotLosses.apply(z, labels, teacher_logp.detach(), outside)
