"""The cheaper train forward (LM head only on the rows the losses read) against the full-logits one.

``_full_logits_cotrain_loss`` is the co-training loss as it was computed before: the LM head on
every packed row, log-probs gathered from the (T,V) logits, and the draft given teacher logits
for all T rows. Loss, metrics and every policy and draft gradient must match.
"""
import pytest
import torch

from codraft.drafts.batch import DraftBatch, supervised_rows
from codraft.drafts import init_draft
from codraft.rl.cotrain import cotrain_loss
from codraft.train.packing import pack
from codraft.rl.grpo import entropy_from_logits, grpo_loss, token_logprobs
from tiny_runs import sample_rollouts, tiny_policy
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
    policy, tok = tiny_policy(seed=3)
    prompts, out = sample_rollouts(policy, tok, n=n)
    policy.double()
    batch = pack(prompts, [o.tokens for o in out], [o.logprobs for o in out])
    torch.manual_seed(1)
    draft = None if kind is None else init_draft(kind, policy, gamma=3).double()
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
    reference = tiny_policy(seed=4)[0].double().eval() if kind is None else None
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


# ---- shared prompt per GRPO group ------------------------------------------------------------


def _group_batch(share, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (6, 9)]
    lens = [[5, 1, 9], [7, 3, 2]]  # completions of very different lengths, one of a single token
    seqs_p, seqs_c, lps = [], [], []
    for p, ls in zip(prompts, lens):
        for n in ls:
            seqs_p.append(p)
            seqs_c.append(torch.randint(1, vocab, (n,), generator=g).tolist())
            lps.append((-torch.rand(n, generator=g)).tolist())
    return pack(seqs_p, seqs_c, lps, share_prompts=share)


def test_shared_prompt_layout():
    b = _group_batch(True, 20)
    sh = b.shared
    assert sh is not None and sh.input_ids.shape[1] == 6 + 9 + 5 + 1 + 9 + 7 + 3 + 2
    assert torch.equal(sh.input_ids[0, sh.gather], b.input_ids[0])  # same tokens, each prompt stored once
    assert sh.layout.prefix == (-1, 0, 0, 0, -1, 4, 4, 4)
    # positions continue after the shared prompt, as in the unshared row
    from codraft.attention import positions_from_cu_seqlens
    assert torch.equal(sh.layout.positions()[sh.gather], positions_from_cu_seqlens(b.cu_seqlens, b.input_ids.shape[1]))
    assert pack([[1, 2], [3]], [[4], [5]], [[0.0], [0.0]]).shared is None  # no repeated prompt


def test_prefix_attention_equals_dense_mask():
    from codraft.attention import PackedCausal, sdpa, varlen_attention
    torch.manual_seed(0)
    cu = torch.tensor([0, 4, 7, 7, 12, 15, 16])
    layout = PackedCausal.of(cu, 19, (-1, 0, 0, 0, -1, 4))  # an empty segment and a padding tail
    q = torch.randn(1, 6, 19, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 19, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 19, 8, dtype=torch.float64, requires_grad=True)
    do = torch.randn(1, 6, 19, 8, dtype=torch.float64)
    o1, o2 = varlen_attention(q, k, v, layout), sdpa(q, k, v, layout)
    torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(o1, (q, k, v), do), torch.autograd.grad(o2, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    m = layout.dense()[0, 0]
    assert m[7, 0] and m[7, 3] and not m[7, 4] and m[8, 7] and not m[7, 8]  # segment 3 sees segment 0 whole
    with pytest.raises(ValueError, match="prefix"):
        PackedCausal.of(cu, 19, (-1, 0, 1, 0, -1, 4))  # a prefix that has a prefix


@pytest.mark.parametrize("kind", [None, "eagle3", "dflash", "dspark", "model"])
def test_shared_prompt_train_step_equals_unshared(kind):
    policy, _ = tiny_policy(seed=3)
    policy.double()
    torch.manual_seed(1)
    draft = None if kind is None else init_draft(kind, policy, gamma=3).double()
    reference = tiny_policy(seed=4)[0].double().eval() if kind is None else None
    vocab = policy.config.vocab_size
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, 0.0], dtype=torch.float64)
    kw = dict(KW, lam=0.7, kl_coef=0.05 if reference is not None else 0.0, reference=reference)
    shared = _run(cotrain_loss, policy, draft, _group_batch(True, vocab), adv, **kw)
    unshared = _run(cotrain_loss, policy, draft, _group_batch(False, vocab), adv, **kw)
    # fp64 model, but RMSNorm normalises in fp32: attention rounding that differs between the
    # layouts surfaces at fp32 level (~1e-7 relative). A wrong mask, position or gradient sum is O(1).
    tol = dict(rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(shared[0], unshared[0], **tol)
    assert shared[1].keys() == unshared[1].keys()
    for k in unshared[1]:
        torch.testing.assert_close(torch.as_tensor(shared[1][k]).double(), torch.as_tensor(unshared[1][k]).double(),
                                   **tol, msg=k)
    for k, g in unshared[2].items():
        if g is None:
            assert shared[2][k] is None, k
        else:
            assert (shared[2][k] - g).abs().max() <= 1e-6 * g.abs().max() + 1e-12, k
    if draft is not None:
        assert float(shared[1]["draft/loss"]) > 0
