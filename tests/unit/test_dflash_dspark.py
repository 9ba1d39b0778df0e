"""DFlash and DSpark block drafts: attention vs. a dense oracle, stop-gradient, training, decoding, I/O.

Oracles: (a) an independent re-implementation of the block forward with an explicit dense mask
over [context ; blocks] keys (notes 2.2: ctx_ok / draft_ok); (d) plain greedy decoding and the
enumerated target distribution of ``test_spec_sampling``; (e) the Markov-corrected q recomputed
from the raw weights.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from codraft import kernels
from codraft.drafts import block_backbone, dflash, dspark
from codraft.drafts.batch import DraftBatch
from codraft.drafts.block_backbone import Blocks, build_target_layer_ids
from codraft.kernels import dispatch
from codraft.models import ModelConfig, Transformer, bf16
from codraft.rollout import Engine, Sampler

from test_spec_sampling import (  # noqa: F401  (target, exact are fixtures)
    N, N_NEW, PROMPT, _histogram, _scaled, chi2_fits, exact, target,
)

KINDS = {"dflash": dflash, "dspark": dspark}


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_theta=1000.0, architectures=["Qwen3ForCausalLM"],
                max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


def _target(cfg: ModelConfig, std: float = 0.3, seed: int = 0) -> Transformer:
    return _scaled(Transformer(cfg), std, seed)


def _perturb(draft, seed: int = 0):
    """Random norms, a non-zero Markov head: every weight matters in the comparisons."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("w2.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return draft


def _draft(kind: str, target: Transformer, **kw):
    torch.manual_seed(1)
    d = KINDS[kind].build(target.config, **kw)
    return _perturb(d).bind_target(target.embed_tokens.weight, target.head_weight)


def _batch(target: Transformer, lens=(13, 21, 9), pad: int = 3, prompt: int = 4, seed: int = 0) -> DraftBatch:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + pad
    ids = torch.randint(0, target.config.vocab_size, (1, t), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    mask = torch.zeros(1, t, dtype=torch.bool)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mask[0, s + prompt:e] = True
    logits, feats = target(ids, cu_seqlens=cu, taps=tuple(range(target.config.num_hidden_layers)))
    return DraftBatch.from_full_logits(ids, cu, mask, {k: v.detach() for k, v in feats.items()}, logits.detach())


# ---- (a) block attention against a dense, explicitly masked re-implementation ------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x (..., T, D) rotated at positions pos (T,), rotate-half convention."""
    d = x.shape[-1]
    ang = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # (T,D/2)
    cos, sin = ang.cos().repeat(1, 2).to(x.dtype), ang.sin().repeat(1, 2).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _naive_block_hidden(draft, batch: DraftBatch, anchors: torch.Tensor, s: int) -> torch.Tensor:
    c = draft.config
    eps, th, hd = c.rms_norm_eps, c.rope_theta, c.head_dim
    ids, cu = batch.input_ids[0], batch.cu_seqlens
    t, n = ids.shape[0], anchors.shape[0]
    seq = torch.tensor([sum(int(i >= e) for e in cu[1:].tolist()) for i in range(t)])  # padding -> len(cu)-1
    pos = torch.tensor([i - (cu[seq[i]].item() if seq[i] < len(cu) - 1 else 0) for i in range(t)])
    ctx = torch.cat([batch.features[l][0] for l in c.target_layer_ids], -1) @ draft.fc.weight.T
    ctx = _rms(ctx, draft.hidden_norm.weight, eps)  # (T,H)
    embed, head = draft._bound()
    mask_vec = draft.mask_embedding if draft.mask_embedding is not None else embed[c.mask_token_id]
    x = torch.stack([torch.cat([embed[ids[a]][None], mask_vec.expand(s - 1, -1)]) for a in anchors.tolist()])
    x = x.reshape(n * s, -1)  # (N·S,H) block-major
    qpos = (pos[anchors][:, None] + torch.arange(s)).reshape(-1)
    # the notes' dense mask over kv in [context (T) ; blocks (N·S)]
    qi, kv = torch.arange(n * s)[:, None], torch.arange(t + n * s)[None]
    a_q = anchors[qi // s]
    kvc = kv.clamp(max=t - 1)
    ctx_ok = (kv < t) & (kv < a_q) & (seq[kvc] == seq[a_q]) & (kv < cu[-1])
    draft_ok = (kv >= t) & ((kv - t) // s == qi // s)
    allowed = ctx_ok | draft_ok  # (N·S, T+N·S)
    for layer in draft.layers:
        at = layer.self_attn
        nh, nkv = at.n_heads, at.n_kv
        xn = _rms(x, layer.input_layernorm.weight, eps)
        q = _rms((xn @ at.q_proj.weight.T).view(-1, nh, hd), at.q_norm.weight, eps).transpose(0, 1)
        kb = _rms((xn @ at.k_proj.weight.T).view(-1, nkv, hd), at.k_norm.weight, eps).transpose(0, 1)
        kc = _rms((ctx @ at.k_proj.weight.T).view(-1, nkv, hd), at.k_norm.weight, eps).transpose(0, 1)
        vb = (xn @ at.v_proj.weight.T).view(-1, nkv, hd).transpose(0, 1)
        vc = (ctx @ at.v_proj.weight.T).view(-1, nkv, hd).transpose(0, 1)
        k = torch.cat([_rope(kc, pos, th), _rope(kb, qpos, th)], 1).repeat_interleave(nh // nkv, 0)
        v = torch.cat([vc, vb], 1).repeat_interleave(nh // nkv, 0)
        scores = (_rope(q, qpos, th) @ k.transpose(1, 2)) / math.sqrt(hd)  # (H,N·S,T+N·S)
        o = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        x = x + o.transpose(0, 1).reshape(n * s, -1) @ at.o_proj.weight.T
        hn = _rms(x, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        x = x + (F.silu(hn @ mlp.gate_proj.weight.T) * (hn @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(x, draft.norm.weight, eps).view(n, s, -1)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("mask_token_id", [None, 60])
def test_block_forward_matches_dense_masked_reference(kind, mask_token_id):
    target = _target(_cfg())
    draft = _draft(kind, target, num_layers=2, block_size=5, mask_token_id=mask_token_id)
    assert (draft.mask_embedding is None) == (mask_token_id is not None)
    batch = _batch(target)
    # first token of a sequence (empty context), mid-sequence, near a sequence end, and a padding anchor
    anchors = torch.tensor([0, 6, 11, 13, 20, 33, 40, 43])
    cu = batch.cu_seqlens
    seq = torch.searchsorted(cu[1:], anchors, right=True)
    ends = torch.cat([cu[1:], cu[-1:]])
    blocks = Blocks(anchors, ends[seq], anchors - torch.where(seq < len(cu) - 1, cu[seq.clamp(max=len(cu) - 2)], 0))
    with torch.no_grad():
        got = draft.block_hidden(batch, blocks, 5)[0]
        want = _naive_block_hidden(draft, batch, anchors, 5)
    torch.testing.assert_close(got[:-1], want[:-1], atol=2e-5, rtol=1e-4)  # the padding anchor is never used
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_anchor_sampling_valid_and_repeatable(kind):
    target = _target(_cfg())
    draft = _draft(kind, target, num_anchors=4)
    batch = _batch(target)
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    b1 = draft.sample_anchors(batch, label_offset=1, generator=g())
    b2 = draft.sample_anchors(batch, label_offset=1, generator=g())
    assert torch.equal(b1.anchors, b2.anchors)
    cu, lm = batch.cu_seqlens.tolist(), batch.loss_mask[0]
    per_seq = [0] * (len(cu) - 1)
    for a, end, p in zip(*b1):
        s = max(i for i in range(len(cu) - 1) if cu[i] <= a)
        per_seq[s] += 1
        assert end == cu[s + 1] and p == a - cu[s] and a + 1 < end and lm[a] and lm[a + 1]
    assert per_seq == [4, 4, 4]  # every sequence has more than 4 valid anchors
    assert not torch.equal(b1.anchors, draft.sample_anchors(batch, label_offset=1,
                                                            generator=torch.Generator().manual_seed(6)).anchors)


def test_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(4, 1) == [2]
    assert build_target_layer_ids(4, 2) == [0, 3]  # the rule would repeat layer 1 on a 4-layer target
    assert build_target_layer_ids(2, 2) == [0, 1]


# ---- (b) stop-gradient, (c) training ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_no_gradient_reaches_the_target(kind):
    target = _target(_cfg(tie_word_embeddings=False))
    target.requires_grad_(True)
    draft = _draft(kind, target)
    batch = _batch(target)  # features and teacher logits detached, as DraftBatch requires
    loss, metrics = draft.loss(batch, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    for name, p in draft.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "target" not in "".join(draft.state_dict()) and len(list(draft.parameters())) == len(draft.state_dict())
    assert metrics["num_blocks"] > 0 and torch.isfinite(metrics["loss"])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_loss_decreases_on_a_fixed_batch(kind):
    target = _target(_cfg())
    draft = _draft(kind, target, num_anchors=16)
    batch = _batch(target, lens=(30, 26), pad=0, prompt=3)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    hist = []
    for _ in range(30):
        loss, metrics = draft.loss(batch, generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        hist.append({k: v.item() for k, v in metrics.items()})
    first, last = hist[0], hist[-1]
    if kind == "dflash":
        assert last["loss"] < 0.6 * first["loss"], [h["loss"] for h in hist]
    else:  # the confidence BCE has a floor (the entropy of c*): check the terms that can fall
        assert last["loss"] < 0.75 * first["loss"], [h["loss"] for h in hist]
        assert last["ce"] < 0.5 * first["ce"] and last["tv"] < 0.8 * first["tv"], (first, last)
    assert last["acc"] > first["acc"] + 0.2, (first["acc"], last["acc"])


@pytest.mark.parametrize("kept_budget", [0, 1 << 30])  # every chunk recomputed in the backward; none
def test_loss_chunking_is_exact(kept_budget, monkeypatch):
    monkeypatch.setattr(block_backbone, "KEPT_LOSS_BYTES", kept_budget)
    recomputed = []
    monkeypatch.setattr(block_backbone, "checkpoint",
                        lambda fn, *a, **kw: recomputed.append(1) or checkpoint(fn, *a, **kw))
    target = _target(_cfg())
    for kind in KINDS:
        draft = _draft(kind, target, num_anchors=16)
        batch = _batch(target)
        grads = []
        for chunk in (1000, 3):
            draft.config.loss_chunk_blocks = chunk
            draft.zero_grad()
            loss, m = draft.loss(batch, generator=torch.Generator().manual_seed(0))
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in draft.parameters()], m))
        torch.testing.assert_close(grads[0][0], grads[1][0])
        for a, b in zip(grads[0][1], grads[1][1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
        for k in grads[0][2]:
            torch.testing.assert_close(grads[0][2][k], grads[1][2][k])
    assert bool(recomputed) == (kept_budget == 0)


def test_recomputed_loss_chunks_keep_bf16_products(monkeypatch):
    """Under bf16 products (``codraft.models.bf16``) a chunk recomputed in the backward, outside the products
    context, runs its products in bf16 again: the same loss and gradients as chunks kept alive."""
    target = _target(_cfg())
    for kind in KINDS:
        draft = _draft(kind, target, num_anchors=16)
        draft.config.loss_chunk_blocks = 3
        batch = _batch(target)
        grads = []
        for kept_budget in (0, 1 << 30):
            monkeypatch.setattr(block_backbone, "KEPT_LOSS_BYTES", kept_budget)
            draft.zero_grad()
            with bf16.products(torch.bfloat16):
                loss, _ = draft.loss(batch, generator=torch.Generator().manual_seed(0))
            loss.backward()
            grads.append([loss.detach()] + [p.grad.clone() for p in draft.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---- decoding: cache path == training path; (d) engine; (e) Markov q -------------------------


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("max_len,extra_slots", [(20, 0), (10, 2)])
def test_decode_block_equals_training_block(kind, max_len, extra_slots):
    """begin + commit build exactly the context the training forward uses for the same anchor, rows at
    different lengths; the decode attention over the cache (blocks written past the context) and, for a
    block that does not fit in the buffer (max_len 10), the two-part one both equal the training block."""
    target = _target(_cfg())
    draft = _draft(kind, target).eval()
    taps = draft.feature_layers
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 61, (2, 16), generator=g)
    with torch.no_grad():
        _, feats = target(ids, taps=taps)
        lengths = torch.tensor([7, 5])  # contexts: features exist for positions < length - 1
        state = draft.begin(ids[:, :7], lengths, {l: f[:, :6] for l, f in feats.items()}, max_len=max_len)
        # commit counts 2 and 5: row b's new features are at positions lengths-1 .. lengths-2+count
        counts = torch.tensor([2, 5])
        pos = (lengths - 1)[:, None] + torch.arange(4 + 1)  # (B,γ+1) with γ = 4
        new = {l: f.gather(1, pos[..., None].expand(-1, -1, f.shape[-1])) for l, f in feats.items()}
        state = draft.commit(state, ids.gather(1, pos + 1), counts, new)
        assert state.ctx_len.tolist() == [8, 9] and torch.equal(state.pending, ids[[0, 1], [8, 9]])
        slots = draft.config.block_size + extra_slots
        assert (9 + slots <= state.k.shape[3]) == (extra_slots == 0)  # which decode attention runs
        got = draft.decode_hidden(state, slots, context_len=10)
        for b, a in enumerate(state.ctx_len.tolist()):
            row = DraftBatch.from_full_logits(ids[b:b + 1], torch.tensor([0, 16]), torch.ones(1, 16, dtype=torch.bool),
                             {l: f[b:b + 1] for l, f in feats.items()}, torch.zeros(1, 16, 61))
            want = draft.block_hidden(row, Blocks(torch.tensor([a]), torch.tensor([16]), torch.tensor([a])), slots)
            torch.testing.assert_close(got[b], want[0, 0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,gamma", [("dflash", None), ("dflash", 3), ("dflash", 9), ("dspark", None),
                                        ("dspark", 2), ("dspark", 9)])
def test_greedy_spec_equals_plain_greedy(kind, gamma):
    target = _target(_cfg(), std=0.4)
    draft = _draft(kind, target)
    assert draft.default_gamma == (6 if kind == "dflash" else 7)
    prompts = [[5, 17, 3, 44, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    for batch in (prompts[:1], prompts):
        plain = Engine(target).generate(batch, 20, temperature=0.0, eos_id=[])
        engine = Engine(target, draft, gamma=gamma)
        spec = engine.generate(batch, 20, temperature=0.0, eos_id=[])
        assert [r.tokens for r in spec] == [r.tokens for r in plain]
        for r, p in zip(spec, plain):
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)
        assert engine.stats.rounds > 0


def test_greedy_spec_with_a_trained_draft_accepts():
    """Self-distillation on the target's own greedy text: a few steps already give τ > 1."""
    target = _target(_cfg(), std=0.4)
    prompts = [[5, 17, 3], [7, 1], [40, 41, 42, 43]]
    texts = [p + r.tokens for p, r in zip(prompts, Engine(target).generate(prompts, 40, temperature=0.0, eos_id=[]))]
    t = max(map(len, texts))
    for kind in KINDS:
        draft = _draft(kind, target, num_anchors=64)
        ids = torch.tensor([sum(texts, [])])
        cu = torch.tensor([0, *torch.tensor([len(x) for x in texts]).cumsum(0).tolist()])
        lm = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():
            logits, feats = target(ids, cu_seqlens=cu, taps=draft.feature_layers)
        batch = DraftBatch.from_full_logits(ids, cu, lm, feats, logits)
        opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
        for step in range(40):
            loss, _ = draft.loss(batch, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
        engine = Engine(target, draft, max_len=t + 8)
        spec = engine.generate(prompts, 40, temperature=0.0, eos_id=[])
        assert [p + r.tokens for p, r in zip(prompts, spec)] == texts
        assert engine.stats.acceptance_length > 1.5, (kind, engine.stats.acceptance_length)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dspark-c"])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8)], ids=["t1", "t0.7-p0.8"])
@pytest.mark.parametrize("vocab", [False, True], ids=["all", "vocab"])
def test_sampling_is_lossless(target, exact, kind, settings, vocab):  # noqa: F811  (fixtures from test_spec_sampling)
    """vocab: a draft vocabulary of the 4 tokens (of 8) the target emits most, so its mass on the
    other 4 can only come through the residual (test_draft_vocab.py). dspark-c: the draft's layer and
    (without top-p) its Markov loop in C (``kernels.enable``)."""
    fast = kind == "dspark-c"
    kind = kind.removesuffix("-c")
    block = dict(block_size=3 if kind == "dflash" else 2)
    if vocab:
        probs = exact(**settings)  # (V,V,V) over the first three new tokens
        marginal = probs.sum((1, 2)) + probs.sum((0, 2)) + probs.sum((0, 1))
        tokens = marginal.argsort(descending=True)[:4]
        assert marginal[tokens].sum() < 2.9  # (the other 4 matter: ≥ 3 % of the tokens)
        draft = _draft(kind, target, draft_vocab_size=4, **block)
        draft.set_vocabulary(tokens)
    else:
        draft = _draft(kind, target, **block)
    calls = []
    if fast:
        kernels.enable(draft.requires_grad_(False))
        for hook in ("fused_block_decode", "fused_markov"):
            real = getattr(draft, hook)
            setattr(draft, hook, lambda *a, _f=real, _n=hook: (r := _f(*a), r is not None and calls.append(_n))[0])
    engine = Engine(target, draft)
    assert engine.gamma == 2
    with dispatch.forcing({"block-layer": "fused"}):
        results = engine.generate([PROMPT] * N, N_NEW, seed=11, eos_id=[], **settings)
    if fast:  # (the Markov loop in C has no top-p: the torch loop runs it)
        assert set(calls) == {"fused_block_decode"} | ({"fused_markov"} if "top_p" not in settings else set())
    assert all(0.01 < a < 0.95 for a in engine.stats.acceptance_per_position), engine.stats.acceptance_per_position
    ok, stat, crit = chi2_fits(_histogram(results), exact(**settings))
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"


@pytest.mark.parametrize("markov", ["vanilla", "gated"])
def test_markov_q_is_what_was_sampled_from(markov):
    target = _target(_cfg())
    draft = _draft("dspark", target, markov=markov, markov_rank=8, block_size=4).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 61, (3, 10), generator=g)
    lengths = torch.tensor([10, 6, 8])
    with torch.no_grad():
        _, feats = target(ids, taps=draft.feature_layers)
        state = draft.begin(ids, lengths, feats, max_len=20)
        sampler = Sampler(0.8, top_k=20, generator=torch.Generator().manual_seed(1))
        x, q = draft.propose(state, 4, sampler, context_len=10)
        h = draft.decode_hidden(state, 4, context_len=10)  # (B,4,H)
    assert x.shape == (3, 4) and q.shape == (3, 4, 61)
    head, mh = target.head_weight.detach(), draft.markov_head
    prev = torch.cat([ids.gather(1, (lengths - 1)[:, None]), x[:, :-1]], 1)  # x_0 = pending, then drafts
    e = mh.w1.weight[prev]  # (B,4,r)
    if markov == "gated":
        e = torch.sigmoid(torch.cat([h, e], -1) @ mh.gate.weight.T + mh.gate.bias) * e
    z = h @ head.T + e @ mh.w2.weight.T
    want = Sampler(0.8, top_k=20).probs(z)
    torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)
    assert (q.gather(-1, x[..., None]) > 0).all()
    # the correction matters: the uncorrected base distribution differs
    assert (Sampler(0.8, top_k=20).probs(h @ head.T) - want).abs().max() > 1e-2


# ---- (f) save / load --------------------------------------------------------------------------


@pytest.mark.parametrize("kind,kw", [("dflash", {}), ("dflash", dict(mask_token_id=3, num_layers=2)),
                                     ("dspark", dict(markov="gated", markov_rank=12))])
def test_save_load_round_trip(kind, kw, tmp_path):
    target = _target(_cfg())
    draft = _draft(kind, target, **kw)
    path = draft.save(tmp_path / "d")
    import json
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [{"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}[kind]]
    assert cfg["block_size"] == 7 and cfg["target_layer_ids"] == list(draft.feature_layers)
    loaded = KINDS[kind].build(target.config, weights=path).bind_target(target.embed_tokens.weight,
                                                                       target.head_weight)
    assert loaded.config == draft.config and loaded.default_gamma == draft.default_gamma
    sd1, sd2 = draft.state_dict(), loaded.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    batch = _batch(target)
    l1, _ = draft.loss(batch, generator=torch.Generator().manual_seed(0))
    l2, _ = loaded.loss(batch, generator=torch.Generator().manual_seed(0))
    assert torch.equal(l1, l2)
    other = "dspark" if kind == "dflash" else "dflash"
    with pytest.raises(ValueError, match="expected"):
        KINDS[other].build(target.config, weights=path)
    with pytest.raises(ValueError, match="vocab_size"):
        KINDS[kind].build(_cfg(vocab_size=62), weights=path)


def test_unbound_draft_errors_clearly():
    draft = dflash.build(_cfg())
    with pytest.raises(RuntimeError, match="bind_target"):
        draft.embed(torch.tensor([1]))
    with pytest.raises(ValueError, match="block_size"):
        dflash.build(_cfg(), block_size=4, gamma=5)
    assert dflash.build(_cfg(), gamma=5).config.block_size == 6
    assert dspark.build(_cfg(), gamma=5).config.block_size == 5


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_decode_calls_make_no_host_sync(kind, monkeypatch):
    """propose/commit never read a device value on the host (CPU proxy: the Python-level readers raise)."""
    target = _target(_cfg())
    draft = _draft(kind, target)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, feats = target(ids, taps=draft.feature_layers)
    state = draft.begin(ids, torch.tensor([9, 6]), feats, max_len=30)
    sampler = Sampler(1.0, generator=torch.Generator().manual_seed(0))

    def boom(*a, **k):
        raise AssertionError("host sync")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    x, q = draft.propose(state, 4, sampler, context_len=9)
    tokens = torch.cat([state.pending[:, None], x], 1)
    state = draft.commit(state, tokens, torch.tensor([2, 5]), {l: f[:, :5] for l, f in feats.items()})
    state = draft.select(state, torch.tensor([1]))
    draft.propose(state, 4, sampler, context_len=14)
    monkeypatch.undo()
    assert state.ctx_len.tolist() == [10]


def test_deepcopy_shares_the_bound_target():
    import copy
    target = _target(_cfg())
    draft = _draft("dspark", target)
    clone = copy.deepcopy(draft)
    assert clone._bound()[0].data_ptr() == target.embed_tokens.weight.data_ptr()
    assert clone.fc.weight.data_ptr() != draft.fc.weight.data_ptr()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_greedy_spec_with_plain_rounds_between_equals_plain(kind, monkeypatch):
    """Draft lengths that jump between 0 (plain steps: the draft's commits wait, then are written in one
    call before the next proposal) and γ, rows finishing at different lengths (waiting commits of
    dropped rows): the engine runs and gives the greedy tokens of plain decoding. (Whatever a draft
    proposes, verification keeps them; that waiting commits are written right, as proposals show, is
    test_block_layers.test_plain_steps_commit_when_drafting_resumes.)"""
    import codraft.rollout.engine as engine_mod
    target = _target(_cfg(), std=0.4)
    draft = _draft(kind, target)
    prompts = [[5, 17, 3, 44, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    plain = Engine(target).generate(prompts, 24, temperature=0.0, eos_id=[])
    eos = [plain[1].tokens[9]]  # row 1 stops early (the others may too)
    plain = Engine(target).generate(prompts, 24, temperature=0.0, eos_id=eos)
    lengths = iter([0, 0, 3, 0, 0, 0, 2, 1, 0, 3] * 10)
    monkeypatch.setattr(engine_mod, "choose", lambda rows, acceptance, cost: next(lengths))
    engine = Engine(target, draft, gamma="auto", cost_model=object())
    spec = engine.generate(prompts, 24, temperature=0.0, eos_id=eos)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert engine.stats.gamma_chosen[0] > 0 and sum(engine.stats.gamma_chosen[1:]) > 0
