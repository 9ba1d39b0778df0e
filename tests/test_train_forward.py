"""The cheaper train forward (LM head only on the rows the losses read) against the full-logits one.

``_full_logits_cotrain_loss`` is the co-training loss as it was computed before: the LM head on
every packed row, log-probs gathered from the (T,V) logits, and the draft given teacher logits
for all T rows. Loss, metrics and every policy and draft gradient must match.
"""
import pytest
import torch

from codraft.drafts.batch import DraftBatch, supervised_rows
from codraft.drafts.offline import build_for
from codraft.rl.cotrain import cotrain_loss, pack
from codraft.rl.grpo import entropy_from_logits, grpo_loss, token_logprobs
from codraft.rollout import Engine
from test_cotrain import _policy, _rollouts

KW = dict(temperature=0.7, eps_low=0.2, eps_high=0.28, norm="token")


def _full_logits_cotrain_loss(policy, draft, batch, advantages, *, temperature, lam, eps_low, eps_high, norm,
                              kl_coef=0.0, reference=None):
    taps = tuple(draft.feature_layers) if draft is not None else None
    out = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, taps=taps)
    logits, feats = out if taps is not None else (out, {})
    rows = (batch.index - 1).clamp_min(0)
    lg = logits[0, rows]  # (N,L,V)
    logp = token_logprobs(lg / temperature, batch.input_ids[0, batch.index])
    ref_logp = None
    if reference is not None:
        with torch.no_grad():
            ref_logits = reference(batch.input_ids, cu_seqlens=batch.cu_seqlens)
            ref_logp = token_logprobs(ref_logits[0, rows] / temperature, batch.input_ids[0, batch.index])
    loss, m = grpo_loss(logp, logp.detach(), advantages, batch.index_mask, eps_low=eps_low, eps_high=eps_high,
                        norm=norm, ref_logprobs=ref_logp, kl_coef=kl_coef, rollout_logprobs=batch.rollout_logprobs)
    metrics = {f"policy/{k}": v for k, v in m.items()}
    metrics["policy/entropy"] = entropy_from_logits(lg.detach() / temperature, batch.index_mask)
    if draft is not None:
        t = batch.input_ids.shape[1]
        db = DraftBatch(batch.input_ids, batch.cu_seqlens, batch.completion,
                        {l: f.detach() for l, f in feats.items()}, logits[0].detach(), torch.arange(t))
        draft_loss, dm = draft.loss(db)
        metrics.update({f"draft/{k}": v for k, v in dm.items()})
        metrics["draft/loss"] = draft_loss.detach()
        loss = loss + lam * draft_loss
    return loss, metrics


def _setup(kind, n=4):
    policy, tok = _policy(seed=3)
    prompts, out = _rollouts(policy, tok, n=n)
    policy.double()
    batch = pack(prompts, [o.tokens for o in out], [o.logprobs for o in out])
    torch.manual_seed(1)
    draft = None if kind is None else build_for(kind, policy, gamma=3).double()
    return policy, draft, batch


def _run(fn, policy, draft, batch, adv, **kw):
    policy.zero_grad(set_to_none=True)
    if draft is not None:
        draft.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the block drafts draw the same anchors
    loss, metrics = fn(policy, draft, batch, adv, **kw)
    loss.backward()
    grads = {f"policy.{n}": p.grad for n, p in policy.named_parameters()}
    if draft is not None:
        grads.update({f"draft.{n}": p.grad for n, p in draft.named_parameters() if p.requires_grad})
    return loss.detach(), metrics, grads


@pytest.mark.parametrize("kind", [None, "eagle3", "dflash", "dspark", "model"])
def test_rows_only_head_equals_full_logits(kind):
    policy, draft, batch = _setup(kind)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    reference = _policy(seed=4)[0].double().eval() if kind is None else None
    kw = dict(KW, lam=0.7, kl_coef=0.05 if reference is not None else 0.0, reference=reference)
    new = _run(cotrain_loss, policy, draft, batch, adv, **kw)
    ref = _run(_full_logits_cotrain_loss, policy, draft, batch, adv, **kw)
    torch.testing.assert_close(new[0], ref[0], rtol=1e-10, atol=1e-12)
    assert new[1].keys() == ref[1].keys()
    for k in ref[1]:
        torch.testing.assert_close(torch.as_tensor(new[1][k]).double(), torch.as_tensor(ref[1][k]).double(),
                                   rtol=1e-9, atol=1e-12, msg=k)
    assert new[2].keys() == ref[2].keys()
    for k, g in ref[2].items():
        if g is None:
            assert new[2][k] is None, k
        else:
            torch.testing.assert_close(new[2][k], g, rtol=1e-8, atol=1e-12, msg=k)
    if draft is not None:
        assert float(new[1]["draft/loss"]) > 0


def test_draft_batch_teacher_rows():
    ids = torch.arange(8)[None]
    lm = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    rows = supervised_rows(lm)
    assert rows.tolist() == [1, 2, 4, 5]
    logits = torch.randn(1, 8, 5)
    b = DraftBatch.from_full_logits(ids, torch.tensor([0, 4, 8]), lm, {}, logits)
    assert torch.equal(b.teacher_at(torch.tensor([[5, 1], [3, 4]])),
                       torch.stack([torch.stack([logits[0, 5], logits[0, 1]]),
                                    torch.stack([torch.zeros(5), logits[0, 4]])]))
    with pytest.raises(ValueError, match="teacher_logits must be"):
        DraftBatch(ids, torch.tensor([0, 8]), lm, {}, logits, rows)
