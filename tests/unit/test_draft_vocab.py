"""Block drafts with a draft vocabulary (``draft_vocab_size`` = K: the draft predicts K target tokens).

Oracles: plain greedy decoding; and the same draft without a vocabulary: a vocabulary holding
every token in another order, with the Markov head's rows permuted to match, gives the same
losses, metrics and proposals. (The enumerated target distribution, with a draft whose q is zero
outside its K tokens: ``test_dflash_dspark.test_sampling_is_lossless[...-vocab]``.)
"""
import pytest
import torch

from codraft.drafts import dflash, dspark
from codraft.export.block import layout
from codraft.rollout import Engine, Sampler

from test_dflash_dspark import KINDS, _batch, _cfg, _draft, _target

pytestmark = pytest.mark.usefixtures("one_thread")


def _with_vocab(kind, target, tokens, **kw):
    draft = _draft(kind, target, draft_vocab_size=len(tokens), **kw)
    draft.set_vocabulary(torch.tensor(tokens))
    return draft


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_proposals_are_target_tokens_in_the_vocabulary(kind):
    target = _target(_cfg(), std=0.4)
    tokens = list(range(3, 61, 2))  # 29 odd ids
    draft = _with_vocab(kind, target, tokens).eval()
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([10, 6, 8])
    with torch.no_grad():
        _, feats = target(ids, taps=draft.feature_layers)
        state = draft.begin(ids, lengths, feats, max_len=20)
        x, q = draft.propose(state, 4, Sampler(1.0, generator=torch.Generator().manual_seed(1)), context_len=10)
    assert set(x.flatten().tolist()) <= set(tokens) and q.shape == (3, 4, 61)
    outside = torch.ones(61, dtype=torch.bool)
    outside[tokens] = False
    assert (q[..., outside] == 0).all() and torch.allclose(q.sum(-1), torch.ones(3, 4))
    assert (q.gather(-1, x[..., None]) > 0).all()
    prompts = [[5, 17, 3, 44, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]  # pending tokens outside too
    plain = Engine(target).generate(prompts, 20, temperature=0.0, eos_id=[])
    spec = Engine(target, draft).generate(prompts, 20, temperature=0.0, eos_id=[])
    assert [r.tokens for r in spec] == [r.tokens for r in plain]


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_permuted_whole_vocabulary_equals_none(kind):
    """Every token, in another order: the losses, metrics and proposals of the draft without a vocabulary."""
    target = _target(_cfg(), std=0.4)
    plain = _draft(kind, target, num_anchors=16)
    perm = torch.randperm(61, generator=torch.Generator().manual_seed(3))
    mapped = _draft(kind, target, num_anchors=16, draft_vocab_size=61)
    mapped.set_vocabulary(perm)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    if kind == "dspark":  # W1's row i and W2's output i belong to token perm[i]; W1's last row: "outside" (unused)
        w1 = state["markov_head.w1.weight"]
        state["markov_head.w1.weight"] = torch.cat([w1[perm], w1[:1]])
        state["markov_head.w2.weight"] = state["markov_head.w2.weight"][perm]
    state["draft_vocab"] = perm
    mapped.load_state_dict(state)
    batch = _batch(target)
    (l1, m1), (l2, m2) = (d.loss(batch, generator=torch.Generator().manual_seed(0)) for d in (plain, mapped))
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    assert m1.keys() == m2.keys()
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-5, atol=1e-6, msg=k)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([9, 5])
    with torch.no_grad():
        _, feats = target(ids, taps=plain.feature_layers)
        for sampler in (Sampler(0.0), Sampler(0.9, generator=torch.Generator().manual_seed(5))):
            (x1, q1), (x2, q2) = (d.propose(d.begin(ids, lengths, feats, max_len=20), 3, sampler, context_len=9)
                                  for d in (plain, mapped))
            if sampler.greedy:
                assert torch.equal(x1, x2)
            else:  # the draws differ (the sampler walks the tokens in another order); the first q does not
                torch.testing.assert_close(q2[:, 0], q1[:, 0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_tokens_outside_get_no_loss(kind):
    """Labels outside the vocabulary drop out of the loss (as if masked): a vocabulary of the tokens
    the batch never predicts leaves nothing to learn."""
    target = _target(_cfg())
    batch = _batch(target)
    seen = set(batch.input_ids[0].tolist())
    unseen = [t for t in range(61) if t not in seen]
    draft = _with_vocab(kind, target, unseen[:4])
    loss, metrics = draft.loss(batch, generator=torch.Generator().manual_seed(0))
    assert float(loss.detach()) == 0.0 and float(metrics["acc"]) == 0.0
    trained = _with_vocab(kind, target, sorted(seen)[:20])
    loss, _ = trained.loss(batch, generator=torch.Generator().manual_seed(0))
    assert float(loss.detach()) > 0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in trained.parameters() if p.grad is not None)


def test_head_rows_follow_the_head_in_place():
    """The gathered head rows are reused until the head changes (an optimiser step, a rollout refresh)."""
    target = _target(_cfg())
    draft = _with_vocab("dflash", target, [4, 9, 2])
    h = torch.randn(2, 48)
    first = draft.logits(h)
    torch.testing.assert_close(first, h @ target.head_weight.detach()[[4, 9, 2]].T)
    with torch.no_grad():
        target.head_weight.mul_(2)
    torch.testing.assert_close(draft.logits(h), 2 * first)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_rollout_then_a_training_step(kind):
    """A co-training step: the rollout proposes under inference mode (gathering the head rows), then the
    draft's loss reuses them with autograd (the head has not changed). The gathered rows must not be an
    inference tensor: that failed the real preset's first update (`codraft train --config smollm2-chainsum`)."""
    target = _target(_cfg())
    draft = _with_vocab(kind, target, list(range(3, 61, 2)))
    Engine(target, draft).generate([[5, 17, 3, 44]], 6, temperature=1.0, seed=0, eos_id=[])  # inference mode
    loss, _ = draft.loss(_batch(target), generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_save_load_and_bad_vocabularies(kind, tmp_path):
    target = _target(_cfg())
    draft = _with_vocab(kind, target, [8, 1, 30, 60, 2])
    loaded = KINDS[kind].build(target.config, weights=draft.save(tmp_path / "d")).bind_target(
        target.embed_tokens.weight, target.head_weight)
    assert loaded.config.draft_vocab_size == 5 and loaded.draft_vocab.tolist() == [8, 1, 30, 60, 2]
    assert loaded.to_draft(torch.tensor([30, 3])).tolist() == [2, -1]
    batch = _batch(target)
    assert torch.equal(*(d.loss(batch, generator=torch.Generator().manual_seed(0))[0] for d in (draft, loaded)))
    for bad in ([1, 2, 3, 4], [1, 1, 2, 3, 4], [1, 2, 3, 4, 61], [-1, 2, 3, 4, 5]):
        with pytest.raises(ValueError, match="distinct token ids"):
            draft.set_vocabulary(torch.tensor(bad))
    with pytest.raises(ValueError, match="whole vocabulary"):
        _draft(kind, target).set_vocabulary(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        KINDS[kind].build(target.config, draft_vocab_size=62)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        layout(draft, kind, target, torch.float32)


def test_builders_take_the_option():
    cfg = _cfg()
    assert dflash.build(cfg, draft_vocab_size=7).out_vocab == 7 and dflash.build(cfg).out_vocab == 61
    d = dspark.build(cfg, draft_vocab_size=7)
    assert d.markov_head.w1.num_embeddings == 8 and d.markov_head.w2.out_features == 7 and d.out_vocab == 7
    assert dspark.build(cfg).markov_head.w1.num_embeddings == 61
