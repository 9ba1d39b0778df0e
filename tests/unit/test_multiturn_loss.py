"""Training on multi-turn episodes: observation tokens are context, never targets.

Oracles: the policy gradient (GRPO + k3 KL) equals, parameter by parameter, an independent per-sequence
computation over the policy's own tokens only; each block draft's loss is unchanged when an observation's
token ids change with everything the draft reads held fixed (its features and teacher rows), and no draft
counts a target whose chain crosses an observation."""
from __future__ import annotations

import copy

import pytest
import torch

from codraft.drafts import build_draft
from codraft.drafts.batch import DraftBatch
from codraft.models import ModelConfig, Transformer
from codraft.rl.cotrain import cotrain_loss
from codraft.rl.microbatch import draft_targets
from codraft.train.packing import pack
from codraft.train.seeding import sequence_seeds

V = 40
PROMPTS = [[1, 5, 6], [1, 5, 6], [1, 9, 2, 8], [1, 9, 2, 8]]
# completions: the policy's tokens (mask 1) around observations (mask 0)
MASKS = [[1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1],
         [1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]]
ADV = torch.tensor([0.7, -0.7, 1.2, -1.2])


def _completions(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (len(m),), generator=g).tolist() for m in MASKS]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return Transformer(cfg)


def test_policy_gradient_and_kl_skip_observations(policy):
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    comps = _completions()
    batch = pack(PROMPTS, comps, masks=[[bool(x) for x in m] for m in MASKS])
    assert int(batch.index_mask.sum()) == sum(map(sum, MASKS))
    policy.zero_grad()
    loss, m = cotrain_loss(policy, None, batch, ADV, temperature=1.0, lam=0.0, eps_low=0.2, eps_high=0.28,
                           norm="token", kl_coef=0.3, reference=ref)
    loss.backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    # the oracle: one plain forward per sequence, the policy's tokens only
    policy.zero_grad()
    total, n_tokens = 0.0, sum(map(sum, MASKS))
    for prompt, comp, mask, a in zip(PROMPTS, comps, MASKS, ADV):
        ids = torch.tensor([prompt + comp])
        logp = policy(ids)[0, len(prompt) - 1:-1].log_softmax(-1).gather(1, torch.tensor(comp)[:, None])[:, 0]
        with torch.no_grad():
            ref_logp = ref(ids)[0, len(prompt) - 1:-1].log_softmax(-1).gather(1, torch.tensor(comp)[:, None])[:, 0]
        keep = torch.tensor(mask, dtype=torch.bool)
        pg = -torch.exp(logp - logp.detach()) * a  # ratio 1: the on-policy step
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        total = total + (pg + 0.3 * kl)[keep].sum() / n_tokens
    total.backward()
    assert abs(float(loss.detach()) - float(total.detach())) <= 1e-5
    for n, p in policy.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-7), n


def _draft_batch(draft, policy, comps):
    batch = pack(PROMPTS, comps, masks=[[bool(x) for x in m] for m in MASKS], share_prompts=False)
    g = torch.Generator().manual_seed(1)
    t = batch.input_ids.shape[1]
    feats = {l: torch.randn(1, t, policy.config.hidden_size, generator=g) for l in draft.feature_layers}
    rows = (batch.index[batch.index_mask] - 1).clamp_min(0)
    return batch, DraftBatch(batch.input_ids, batch.cu_seqlens, batch.completion, feats,
                             torch.randn(rows.numel(), V, generator=g), rows,
                             seeds=sequence_seeds(7, 0, len(PROMPTS)))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_draft_loss_ignores_observation_tokens(policy, kind):
    torch.manual_seed(2)
    draft = build_draft(kind, policy.config, target=policy, num_anchors=64)
    comps = _completions()
    _, db = _draft_batch(draft, policy, comps)
    loss, _ = draft.loss(db)
    other = [[t if m else (t + 11) % V for t, m in zip(c, mask)] for c, mask in zip(comps, MASKS)]
    _, db2 = _draft_batch(draft, policy, other)  # the same features and teacher rows: only observation ids differ
    loss2, _ = draft.loss(db2)
    assert torch.equal(loss, loss2)
    # and the mask matters: the same batch with the observations as targets is a different loss
    db3 = DraftBatch(db.input_ids, db.cu_seqlens, db.loss_mask | (db.input_ids > 0), db.features, db.teacher_logits,
                     db.teacher_rows, seeds=db.seeds)
    assert not torch.equal(loss, draft.loss(db3)[0])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_no_block_slot_past_an_observation(policy, kind):
    """A block's slot k is supervised only if its anchor's chain a..a+k (DSpark: ..a+k+1) stays in one turn."""
    draft = build_draft(kind, policy.config, target=policy, num_anchors=64)
    _, db = _draft_batch(draft, policy, _completions())
    blocks = draft.sample_anchors(db, label_offset=1)
    m = draft._targets(db, blocks)[-1].bool()  # (N,S)
    kinds = "".join("P" * len(p) + "".join("T" if x else "O" for x in mk) for p, mk in zip(PROMPTS, MASKS))
    seq_end = blocks.seq_end.tolist()
    extra = 1 if kind == "dspark" else 0  # DSpark's slot k predicts x_{a+k+1}
    for n, a in enumerate(blocks.anchors.tolist()):
        for k in range(m.shape[1]):
            q = a + k + extra  # the label's position
            want = k + extra >= 1 and q < seq_end[n] and kinds[q] == "T" and "O" not in kinds[a:q + 1]
            assert bool(m[n, k]) == want, (a, k)
    assert m.any()


def test_no_draft_target_chain_crosses_an_observation(policy):
    comps = _completions()
    batch, db = _draft_batch(build_draft("eagle3", policy.config, target=policy), policy, comps)
    # pairs (t, t+1) of the policy's tokens: the draft's targets
    want = sum(sum(a and b for a, b in zip(m[:-1], m[1:])) for m in MASKS)
    assert draft_targets(batch) == want
    eagle = build_draft("eagle3", policy.config, target=policy)
    n = eagle.loss_normaliser(db)
    steps = eagle.ttt_steps
    # TTT step j from draft row t = q - 2 - j >= 0 predicts target x_q through the chain x_{t+1}..x_q: no
    # observation in it (the prompt may start it, as the pending token follows the prompt at decode time)
    kinds = ["P" * len(p) + "".join("T" if x else "O" for x in m) for p, m in zip(PROMPTS, MASKS)]
    for j in range(steps):
        expect = sum(k[q] == "T" and q - 2 - j >= 0 and "O" not in k[q - 1 - j:q + 1]
                     for k in kinds for q in range(len(k)))
        assert int(n[j]) == expect, j
    assert int(n[0]) > int(n[steps - 1]) > 0
