"""GRPO advantages and loss against hand-computed values on a tiny batch.

Expected numbers are written out by hand (with the arithmetic in comments) or
recomputed with scalar `math` loops, never with the vectorised code under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from codraft.rl.grpo import (
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    masked_mean,
    token_logprobs,
)


def close(a, b, tol=1e-6):
    a, b = (x.detach() if isinstance(x, torch.Tensor) else x for x in (a, b))
    return abs(float(a) - float(b)) <= tol


def grads_equal(grad, expected, tol=1e-6):
    return torch.allclose(grad, torch.tensor(expected), atol=tol, rtol=0)


# ---------------------------------------------------------------------------- advantages
# Two groups of n=3: [1, 0, 0.5] (mean 0.5, unbiased var (.25+.25+0)/2 = .25, std .5)
# and [2, 2, 2] (zero variance).
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])


def test_advantages_plain():
    adv = group_advantages(REWARDS, 3, eps=0.0)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0, 0.0], abs=1e-7)
    adv = group_advantages(REWARDS, 3)  # default eps=1e-6 sits in the denominator
    s = 0.5 / (0.5 + 1e-6)
    assert adv.tolist() == pytest.approx([s, -s, 0.0, 0.0, 0.0, 0.0], abs=1e-7)


def test_advantages_no_std():
    adv = group_advantages(REWARDS, 3, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0], abs=1e-7)


def test_advantages_leave_one_out():
    # b_1 = (0 + .5)/2 = .25 -> (1 - .25)/.5 = 1.5 ; b_2 = (1 + .5)/2 = .75 -> -1.5 ; b_3 = .5 -> 0
    adv = group_advantages(REWARDS, 3, leave_one_out=True, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0, 0.0, 0.0, 0.0], abs=1e-7)
    adv = group_advantages(REWARDS, 3, leave_one_out=True, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.75, 0.0, 0.0, 0.0, 0.0], abs=1e-7)


def test_advantages_zero_variance_exact():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.3, 0.9, 0.3])
    for loo in (False, True):
        for ns in (False, True):
            adv = group_advantages(r, 3, leave_one_out=loo, normalize_std=ns)
            assert torch.equal(adv[:6], torch.zeros(6))  # exactly 0, no float residue
            assert adv[6:].abs().min() > 0
    assert torch.equal(group_advantages(torch.tensor([3.0, 5.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(REWARDS, 4)


# ---------------------------------------------------------------------------- loss batch
# B=2 rows, T=4 slots. Row 0: 3 tokens, A=+1, ratios (1.5, 1.1, 0.5). Row 1: 2 tokens,
# A=-2, ratios (0.5, 1.5). eps_low=.2, eps_high=.28 -> clip range [0.8, 1.28].
#   row0 t0: -min(1.5, 1.28)        = -1.28   clipped high (zero grad)
#   row0 t1: -min(1.1, 1.1)         = -1.1
#   row0 t2: -min(0.5, 0.8)         = -0.5    (A>0, rho<1-eps: NOT clipped)
#   row1 t0: -min(-1.0, -1.6)       = +1.6    clipped low (zero grad)
#   row1 t1: -min(-3.0, -2.56)      = +3.0    (A<0, rho>1+eps: NOT clipped)
# token norm:    (-1.28 - 1.1 - 0.5 + 1.6 + 3.0) / 5 = 1.72 / 5 = 0.344
# sequence norm: ((-2.88)/3 + (4.6)/2) / 2 = (-0.96 + 2.3) / 2 = 0.67
RATIOS = [[1.5, 1.1, 0.5], [0.5, 1.5]]
ADV = torch.tensor([1.0, -2.0])
PG = [[-1.28, -1.1, -0.5], [1.6, 3.0]]
PAD_GARBAGE = 7.0  # finite junk in padded slots must not matter


def make_batch():
    old = torch.full((2, 4), -1.0)
    logp = torch.full((2, 4), PAD_GARBAGE)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    for i, row in enumerate(RATIOS):
        for t, rho in enumerate(row):
            logp[i, t] = -1.0 + math.log(rho)
            mask[i, t] = True
    return logp.requires_grad_(True), old, mask


def test_clipped_surrogate_token_norm_and_grads():
    logp, old, mask = make_batch()
    loss, m = grpo_loss(logp, old, ADV, mask)
    assert close(loss, 0.344)
    assert close(m["loss"], 0.344) and close(m["pg_loss"], 0.344)
    assert close(m["clip_frac_high"], 1 / 5) and close(m["clip_frac_low"], 1 / 5)
    assert close(m["clip_frac"], 2 / 5)
    assert close(m["ratio_mean"], (1.5 + 1.1 + 0.5 + 0.5 + 1.5) / 5)
    assert close(m["ratio_min"], 0.5) and close(m["ratio_max"], 1.5)
    assert close(m["num_tokens"], 5)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())

    loss.backward()
    # unclipped: d(-rho*A)/dlogp = -rho*A, divided by 5 tokens; clipped and padded: 0
    expected = [[0.0, -1.1 / 5, -0.5 / 5, 0.0], [0.0, 3.0 / 5, 0.0, 0.0]]
    assert grads_equal(logp.grad, expected)
    assert logp.grad[0, 0] == 0 and logp.grad[1, 0] == 0  # exactly zero on clipped tokens


def test_sequence_norm_differs_and_matches_hand_value():
    logp, old, mask = make_batch()
    tok, _ = grpo_loss(logp, old, ADV, mask, norm="token")
    seq, _ = grpo_loss(logp, old, ADV, mask, norm="sequence")
    assert close(seq, 0.67)
    assert close(tok, 0.344) and not close(tok, seq, tol=0.3)
    seq.backward()
    # row 0 tokens divided by 3 (its length) * 2 (rows); row 1 by 2 * 2
    expected = [[0.0, -1.1 / 6, -0.5 / 6, 0.0], [0.0, 3.0 / 4, 0.0, 0.0]]
    assert grads_equal(logp.grad, expected)


def test_symmetric_clip_changes_result():
    logp, old, mask = make_batch()
    loss, m = grpo_loss(logp, old, ADV, mask, eps_high=0.2)
    # row0 t0 now clipped at 1.2 instead of 1.28: (1.72 + 0.08) / 5
    assert close(loss, 1.8 / 5)
    assert close(m["clip_frac_high"], 1 / 5)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_microbatches_sum_to_full_batch(norm):
    logp, old, mask = make_batch()
    full, _ = grpo_loss(logp, old, ADV, mask, norm=norm)
    (g_full,) = torch.autograd.grad(full, logp)
    total = 0.0
    g_acc = torch.zeros_like(logp)
    for rows in ([0], [1]):
        lp = logp.detach()[rows].requires_grad_(True)
        part, _ = grpo_loss(lp, old[rows], ADV[rows], mask[rows], norm=norm,
                            global_tokens=5, global_sequences=2)
        part.backward()
        total += float(part.detach())
        g_acc[rows] = lp.grad
    assert close(total, full)
    assert torch.allclose(g_acc, g_full, atol=1e-7)
    # without global counts the micro-batch means do NOT add up to the full loss
    p0, _ = grpo_loss(logp.detach()[[0]], old[[0]], ADV[[0]], mask[[0]], norm=norm)
    p1, _ = grpo_loss(logp.detach()[[1]], old[[1]], ADV[[1]], mask[[1]], norm=norm)
    assert not close(float(p0) + float(p1), full, tol=1e-3)


# ---------------------------------------------------------------------------- KL, mismatch
REF_DELTA = [[0.1, -0.2, 0.0], [0.3, -0.1]]  # ref - logp on the real tokens
ROLL_DELTA = [[0.1, -0.05, 0.0], [0.2, 0.0]]  # old - rollout on the real tokens


def k3(x: float) -> float:
    return math.exp(x) - x - 1.0


def test_k3_kl_to_reference():
    logp, old, mask = make_batch()
    ref = torch.full((2, 4), -30.0)  # junk in padding
    for i, row in enumerate(REF_DELTA):
        for t, d in enumerate(row):
            ref[i, t] = logp[i, t].item() + d
    kls = [k3(d) for row in REF_DELTA for d in row]
    # k3(0.1) = e^0.1 - 1.1 = 0.0051709...
    assert close(kls[0], 0.005170918)
    loss, m = grpo_loss(logp, old, ADV, mask, ref_logprobs=ref, kl_coef=0.1)
    assert close(m["kl_ref"], sum(kls) / 5)
    assert close(loss, 0.344 + 0.1 * sum(kls) / 5)
    assert close(m["pg_loss"], 0.344)
    loss.backward()
    # d k3 / d logp = 1 - e^(ref - logp); row0 t1 is unclipped: (-1.1 + 0.1 (1 - e^-0.2)) / 5
    assert close(logp.grad[0, 1], (-1.1 + 0.1 * (1 - math.exp(-0.2))) / 5)
    # a clipped token still gets the KL gradient
    assert close(logp.grad[0, 0], 0.1 * (1 - math.exp(0.1)) / 5)
    # ref given, kl_coef 0: metric only, loss unchanged
    loss0, m0 = grpo_loss(logp.detach(), old, ADV, mask, ref_logprobs=ref)
    assert close(loss0, 0.344) and close(m0["kl_ref"], sum(kls) / 5)


def make_rollout(old):
    roll = torch.full((2, 4), 5.0)  # junk in padding
    for i, row in enumerate(ROLL_DELTA):
        for t, d in enumerate(row):
            roll[i, t] = old[i, t] - d
    return roll


def test_mismatch_metrics():
    logp, old, mask = make_batch()
    _, m = grpo_loss(logp, old, ADV, mask, rollout_logprobs=make_rollout(old))
    ds = [d for row in ROLL_DELTA for d in row]
    assert close(m["token_mult_prob_error"], sum(math.exp(abs(d)) for d in ds) / 5)
    assert close(m["rollout_kl"], sum(k3(d) for d in ds) / 5)
    assert close(m["rollout_kl_k1"], -(0.1 - 0.05 + 0.2) / 5)
    assert close(m["rollout_is_ratio"], sum(math.exp(d) for d in ds) / 5)
    # identical distributions -> error exactly 1, KL exactly 0
    _, m = grpo_loss(logp, old, ADV, mask, rollout_logprobs=old.clone())
    assert m["token_mult_prob_error"] == 1 and m["rollout_kl"] == 0


def test_truncated_importance_sampling():
    logp, old, mask = make_batch()
    cap = 1.1  # e^0.2 = 1.2214 > cap gets truncated; e^0.1 = 1.105 > cap too
    loss, m = grpo_loss(logp, old, ADV, mask, rollout_logprobs=make_rollout(old),
                        is_correction="token", is_cap=cap)
    ws = [min(math.exp(d), cap) for row in ROLL_DELTA for d in row]
    pgs = [p for row in PG for p in row]
    assert close(loss, sum(w * p for w, p in zip(ws, pgs)) / 5)
    assert close(m["is_weight_mean"], sum(ws) / 5)
    assert close(m["is_capped_frac"], 2 / 5)
    loss.backward()
    assert close(logp.grad[0, 1], ws[1] * -1.1 / 5)  # weight is a constant factor
    with pytest.raises(ValueError, match="rollout_logprobs"):
        grpo_loss(logp, old, ADV, mask, is_correction="token")


def test_bad_shapes_named():
    logp, old, mask = make_batch()
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(logp, old[:, :3], ADV, mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, old, ADV[:1], mask)


# ---------------------------------------------------------------------------- helpers

def test_token_logprobs_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 4
    tgt = torch.randint(0, 11, (2, 5), generator=g)
    ref = logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    for cs in (None, 1, 3, 100):
        assert torch.allclose(token_logprobs(logits, tgt, chunk_size=cs), ref, atol=1e-5)
    # scalar check of one entry: z_t - log sum_v e^{z_v}
    z = logits[1, 2].tolist()
    assert close(token_logprobs(logits, tgt)[1, 2], z[tgt[1, 2]] - math.log(sum(math.exp(v) for v in z)), 1e-5)
    # low-precision logits are up-cast: result is fp32 and close to the fp32 reference
    out = token_logprobs(logits.bfloat16(), tgt, chunk_size=4)
    ref16 = logits.bfloat16().float().log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32 and torch.allclose(out, ref16, atol=1e-5)
    # gradient matches too
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    token_logprobs(a, tgt, chunk_size=3).sum().backward()
    b.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, -1.0, 0.5]],
                           [[1e4, 0.0, 0.0, 0.0], [float("nan")] * 4]])  # last row masked
    mask = torch.tensor([[1, 1], [1, 0]])

    def h(z):
        lse = max(z) + math.log(sum(math.exp(v - max(z)) for v in z))
        return -sum(math.exp(v - lse) * (v - lse) for v in z)

    expected = (math.log(4) + h([2.0, 0.0, -1.0, 0.5]) + 0.0) / 3
    for cs in (None, 1, 2, 16):
        assert close(entropy_from_logits(logits, mask, chunk_size=cs), expected, 1e-5)
    hot = (math.log(4) + h([1.0, 0.0, -0.5, 0.25]) + h([5e3, 0.0, 0.0, 0.0])) / 3  # the logits / 2
    assert close(entropy_from_logits(logits, mask, temperature=2.0, chunk_size=1), hot, 1e-5)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert close(masked_mean(x, mask), (1 + 2 + 4 + 6) / 4)
    assert masked_mean(x, mask, dim=-1).tolist() == pytest.approx([1.5, 5.0])
    assert masked_mean(x, torch.zeros_like(mask)) == 0


def test_plot_trailing_mean():
    from codraft.rl.plots import trailing_mean
    ys = [1.0, 3.0, 5.0, 7.0, 9.0]
    assert trailing_mean(ys, window=3) == pytest.approx([1.0, 2.0, 3.0, 5.0, 7.0])
    assert trailing_mean(ys, window=1) == ys
    assert trailing_mean([], window=4) == []
