"""EAGLE-3 draft: TTT loss against an independent oracle, stop-gradient, training, decoding, checkpoints.

Oracles:
  * the TTT loss equals a naive per-sequence implementation (no packing, SpecForge-style
    attention: one softmax over [q·k_0ᵀ + causal mask, (q⊙k_1).sum(-1), ..., (q⊙k_j).sum(-1)],
    positions and masks by explicit loops), values and gradients, fp64;
  * decoding equals TTT: every q row of propose (after begin, commits with various acceptance
    counts, and select) equals the TTT step-j distribution at anchor len-2 of the same sequence;
  * with the engine, greedy speculative output equals plain greedy output, and sampled output
    matches the target's exact distribution (helpers of test_spec_sampling);
  * checkpoints have exactly the public EAGLE-3 tensor names and shapes and round-trip exactly.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from codraft.drafts.batch import DraftBatch
from codraft.drafts.eagle3 import build, load
from codraft.drafts.eagle3_layer import default_layers, vocab_map
from codraft.models import ModelConfig, Transformer
from codraft.models.layers import apply_rope, rope_cos_sin
from codraft.rollout import Engine, Sampler
from test_spec_sampling import N_NEW, PROMPT, V, _histogram, _scaled, chi2_fits, exact_distribution

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(vocab=48, layers=4, heads=4, kv=2, hidden=32) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128)


def _counts(v: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 5, (v,), generator=torch.Generator().manual_seed(seed))


def _setup(dtype=F64, vocab=48, draft_vocab=40, ttt_steps=3, seed=0, std=0.3):
    """A peaked random target and a bound EAGLE-3 draft (draft vocab smaller than the target's)."""
    torch.manual_seed(seed)
    target = _scaled(Transformer(_cfg(vocab)), std, seed).to(dtype)
    draft = build(target.config, ttt_steps=ttt_steps, draft_vocab_size=draft_vocab, token_counts=_counts(vocab))
    draft = draft.to(dtype).bind_target(target.embed_tokens.weight, target.head_weight)
    return target, draft


def _packed_batch(target, draft, lens=(9, 1, 12, 6), pad=3, seed=0) -> DraftBatch:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + pad
    ids = torch.randint(0, target.config.vocab_size, (1, t), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    with torch.no_grad():
        logits, feats = target(ids, taps=tuple(draft.layers), cu_seqlens=cu)
    loss_mask = torch.rand(1, t, generator=g) < 0.8
    return DraftBatch.from_full_logits(ids, cu, loss_mask, feats, logits)


# ---- naive oracle -----------------------------------------------------------------------------


def _naive_loss(d, batch: DraftBatch) -> torch.Tensor:
    """Per sequence, unpacked; attention as in SpecForge's SDPA path; masks by explicit loops."""
    c, m, a = d.config, d.midlayer, d.midlayer.self_attn
    hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    emb_w = d._target[0].detach()
    used = d.d2t + torch.arange(d.draft_vocab_size)
    steps = d.ttt_steps
    num, cnt = [0.0] * steps, [0] * steps
    cu = batch.cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        x, n = batch.input_ids[0, s0:s1].tolist(), s1 - s0
        lm = batch.loss_mask[0, s0:s1].tolist()
        # an observation: a non-target after a target of the sequence (multi-turn); no chain crosses one
        obs = [not lm[i] and any(lm[:i]) for i in range(n)]
        hidden = F.linear(torch.cat([batch.features[l][0, s0:s1] for l in d.layers], -1), d.fc.weight)  # (n,H)
        keys, values = [], []
        for j in range(steps):
            tok = torch.tensor([x[t + 1 + j] if t + 1 + j < n else 0 for t in range(n)])
            xin = torch.cat([m.input_layernorm(emb_w[tok]), m.hidden_norm(hidden)], -1)  # (n,2H)
            cos, sin = rope_cos_sin(d.inv_freq, (torch.arange(n) + j)[None], xin.dtype)  # (1,1,n,D)
            q = apply_rope(F.linear(xin, a.q_proj.weight).view(n, hq, hd).transpose(0, 1)[None], cos, sin)[0]
            k = apply_rope(F.linear(xin, a.k_proj.weight).view(n, hkv, hd).transpose(0, 1)[None], cos, sin)[0]
            v = F.linear(xin, a.v_proj.weight).view(n, hkv, hd).transpose(0, 1)  # (Hkv,n,D)
            keys.append(k)
            values.append(v)
            heads = []
            for h in range(hq):
                kv = h // (hq // hkv)
                s_main = q[h] @ keys[0][kv].T / math.sqrt(hd)  # (n,n)
                s_main = s_main.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
                s_diag = [(q[h] * keys[i][kv]).sum(-1, keepdim=True) / math.sqrt(hd) for i in range(1, j + 1)]
                p = torch.cat([s_main, *s_diag], -1).softmax(-1)  # (n, n + j)
                o = p[:, :n] @ values[0][kv]
                for i in range(1, j + 1):
                    o = o + p[:, n + i - 1:n + i] * values[i][kv]
                heads.append(o)
            h1 = hidden + F.linear(torch.cat(heads, -1), a.o_proj.weight)
            hidden = h1 + m.mlp(m.post_attention_layernorm(h1))
            logp = F.log_softmax(F.linear(d.norm(hidden), d.lm_head.weight), -1)  # (n,V_d)
            for t in range(n):
                tt = s0 + t + 1 + j  # teacher row; predicts token tt + 1
                if t + 2 + j < n and batch.loss_mask[0, tt + 1] and not any(obs[t + 1:t + 3 + j]) \
                        and d.t2d[batch.teacher_at(torch.tensor(tt)).argmax()]:
                    p = batch.teacher_at(torch.tensor(tt))[used].softmax(-1)
                    num[j] = num[j] - (p * logp[t]).sum()
                    cnt[j] += 1
    return sum(0.8 ** j * num[j] / max(cnt[j], 1) for j in range(steps))


def test_ttt_loss_matches_naive_oracle():
    target, d = _setup(ttt_steps=3)
    batch = _packed_batch(target, d, lens=(8, 1, 10, 5))
    loss, metrics = d.loss(batch)
    ref = _naive_loss(d, batch)
    assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    g = torch.autograd.grad(loss, list(d.parameters()))
    g_ref = torch.autograd.grad(ref, list(d.parameters()))
    for (name, _), a, b in zip(d.named_parameters(), g, g_ref):
        assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)
    assert set(metrics) == {"loss", *(f"step{j}/{k}" for j in range(3) for k in ("loss", "acc", "positions"))}
    assert all(metrics[f"step{j}/positions"] > 0 for j in range(3))
    total, _ = d.loss(batch, reduction="sum")
    per_step = sum(0.8 ** j * metrics[f"step{j}/loss"] * metrics[f"step{j}/positions"] for j in range(3))
    assert_close(total.detach(), per_step)


def test_no_gradient_reaches_target():
    torch.manual_seed(0)
    target = Transformer(_cfg())
    d = build(target.config, ttt_steps=2).bind_target(target.embed_tokens.weight, target.head_weight)
    d.init_from_target()
    ids, cu = torch.randint(0, 48, (1, 20)), torch.tensor([0, 11, 20])
    logits, feats = target(ids, taps=tuple(d.layers), cu_seqlens=cu)  # the policy forward, with grad
    assert logits.requires_grad and target.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="requires grad"):
        DraftBatch.from_full_logits(ids, cu, torch.ones(1, 20, dtype=torch.bool), feats, logits.detach())
    batch = DraftBatch.from_full_logits(ids, cu, torch.ones(1, 20, dtype=torch.bool), {l: f.detach() for l, f in feats.items()},
                       logits.detach())
    assert not any(f.requires_grad for f in batch.features.values()) and not batch.teacher_logits.requires_grad
    loss, _ = d.loss(batch)
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert not any("embed" in k for k in d.state_dict())


# ---- decoding equals TTT ------------------------------------------------------------------------


def _pad(rows: list[list[int]]) -> torch.Tensor:
    t = max(map(len, rows))
    return torch.tensor([r + [0] * (t - len(r)) for r in rows])


def _ttt_probs(target, d, seq: list[int], anchor: int, steps: int) -> torch.Tensor:
    """softmax over the target vocab of TTT steps 0..steps-1 at row ``anchor`` of one sequence: (steps,V)."""
    ids = torch.tensor(seq)[None]
    with torch.no_grad():
        _, feats = target(ids, taps=tuple(d.layers))
    batch = DraftBatch.from_full_logits(ids, torch.tensor([0, len(seq)]), torch.ones_like(ids, dtype=torch.bool), feats,
                       torch.zeros(1, len(seq), d.vocab_size, dtype=F64))
    old, d.ttt_steps = d.ttt_steps, steps
    try:
        with torch.no_grad():
            logits = d.ttt_logits(batch)
    finally:
        d.ttt_steps = old
    return torch.stack([d.full_logits(l[0, anchor]).softmax(-1) for l in logits])


def _check_proposal(target, d, contexts, x, q):
    gamma = x.shape[1]
    for b, ctx in enumerate(contexts):
        ref = _ttt_probs(target, d, ctx + x[b, :gamma - 1].tolist(), len(ctx) - 2, gamma)
        assert_close(q[b], ref.float(), rtol=1e-5, atol=1e-7)
        assert (q[b, :, ~d.t2d] == 0).all()  # nothing outside the draft vocabulary


def test_decode_matches_ttt():
    target, d = _setup(ttt_steps=3, std=0.5)
    gamma, g = 3, torch.Generator().manual_seed(5)
    sampler = Sampler(1.0, generator=g)
    contexts = [torch.randint(0, 48, (n,), generator=g).tolist() for n in (5, 8)]
    with torch.no_grad():
        _, feats = target(_pad(contexts), taps=tuple(d.layers))
    state = d.begin(_pad(contexts), torch.tensor([5, 8]), feats, max_len=40)
    for accepted in ([2, 0], [1, 3], [0, 1]):
        x, q = d.propose(state, gamma, sampler, context_len=max(map(len, contexts)))
        _check_proposal(target, d, contexts, x, q)
        correction = torch.randint(0, 48, (2, 1), generator=g)
        tokens = torch.cat([x, correction], 1)
        tokens[0, accepted[0]] = correction[0, 0]  # x_1..x_n accepted, then the correction/bonus token
        tokens[1, accepted[1]] = correction[1, 0]
        counts = torch.tensor(accepted) + 1
        old = [len(c) for c in contexts]
        contexts = [c + tokens[b, :counts[b]].tolist() for b, c in enumerate(contexts)]
        with torch.no_grad():
            _, full = target(_pad(contexts), taps=tuple(d.layers))
        at = (torch.tensor(old)[:, None] - 1 + torch.arange(gamma + 1)).clamp(max=full[d.layers[0]].shape[1] - 1)
        new_feats = {l: f.gather(1, at[..., None].expand(-1, -1, f.shape[-1])) for l, f in full.items()}
        state = d.commit(state, tokens, counts, new_feats)
    state = d.select(state, torch.tensor([1]))
    x, q = d.propose(state, gamma, sampler, context_len=len(contexts[1]))
    _check_proposal(target, d, contexts[1:], x, q)


# ---- engine --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained():
    """30 AdamW steps on one fixed packed batch: the target's greedy continuations of 8 random prompts."""
    target, d = _setup(dtype=torch.float32, vocab=48, draft_vocab=48, ttt_steps=3, std=0.5)
    target.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 48, (3,), generator=g).tolist() for _ in range(8)]
    outs = Engine(target).generate(prompts, 24, temperature=0.0)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    ids = torch.tensor([sum(seqs, [])])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    with torch.no_grad():
        logits, feats = target(ids, taps=tuple(d.layers), cu_seqlens=cu)
    batch = DraftBatch.from_full_logits(ids, cu, torch.ones_like(ids, dtype=torch.bool), feats, logits)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    history = []
    for _ in range(30):
        loss, metrics = d.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.item(), metrics["step0/acc"].item()))
    return target, d.eval(), seqs, history


def test_loss_decreases_on_fixed_batch(trained):
    losses, accs = zip(*trained[3])
    # soft CE has the teacher entropy as its floor (about 1.7 per step here): the gap closes steadily
    assert all(b < a for a, b in zip(losses[::5], losses[5::5])), losses
    assert losses[-1] < 0.8 * losses[0], losses
    assert accs[0] < 0.15 and accs[-1] > 0.4, accs


@pytest.mark.parametrize("lens", [(6,), (3, 9, 5)], ids=["b1", "b3"])
def test_engine_greedy_equals_plain(trained, lens):
    target, d, seqs, _ = trained
    prompts = [s[:n] for s, n in zip(seqs[1:], lens)]  # seen in training: the draft is often right
    plain = Engine(target).generate(prompts, 20, temperature=0.0)
    engine = Engine(target, d, gamma=3)
    spec = engine.generate(prompts, 20, temperature=0.0)
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens
        assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    assert engine.stats.accepted > 0  # the accept path (commit with counts > 1) ran


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8)], ids=["t1", "t0.7-p0.8"])
def test_engine_sampling_is_lossless(settings):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    target = _scaled(Transformer(cfg), 0.35, seed=0)  # the target of test_spec_sampling
    d = build(cfg, ttt_steps=2, draft_vocab_size=6, token_counts=_counts(V, seed=3))  # q = 0 on two tokens
    _scaled(d, 0.1, seed=2).bind_target(target.embed_tokens.weight, target.head_weight)
    engine = Engine(target, d, gamma=2)
    results = engine.generate([PROMPT] * 4000, N_NEW, seed=11, eos_id=[], **settings)
    assert all(0.01 < a < 0.9 for a in engine.stats.acceptance_per_position), engine.stats.acceptance_per_position
    ok, stat, crit = chi2_fits(_histogram(results), exact_distribution(target, settings["temperature"], 0,
                                                                     settings.get("top_p", 1.0)))
    assert ok, f"chi2 {stat:.1f} >= critical {crit:.1f}"


# ---- checkpoint, vocabulary, options -------------------------------------------------------------

PUBLIC = ["fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
          "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
          "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
          "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
          "norm.weight", "lm_head.weight", "d2t", "t2d"]


def test_checkpoint_public_layout_and_round_trip(tmp_path):
    cfg = _cfg(vocab=48, layers=8, heads=4, kv=2, hidden=32)
    d = build(cfg, draft_vocab_size=40, token_counts=_counts(48), intermediate_size=80, ttt_steps=5)
    d.save(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    h, hd = 32, 8
    shapes = {"fc.weight": (h, 3 * h), "lm_head.weight": (40, h), "d2t": (40,), "t2d": (48,), "norm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (4 * hd, 2 * h), "midlayer.self_attn.k_proj.weight": (2 * hd, 2 * h),
              "midlayer.self_attn.v_proj.weight": (2 * hd, 2 * h), "midlayer.self_attn.o_proj.weight": (h, 4 * hd),
              "midlayer.mlp.gate_proj.weight": (80, h), "midlayer.mlp.up_proj.weight": (80, h),
              "midlayer.mlp.down_proj.weight": (h, 80),
              **{f"midlayer.{n}.weight": (h,) for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}}
    assert sorted(tensors) == sorted(PUBLIC)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (48, 40, 32)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] == default_layers(8)
    assert config["codraft"]["ttt_steps"] == 5
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rope_theta", "rope_scaling", "max_position_embeddings", "rms_norm_eps"):
        assert key in config

    e = load(tmp_path / "a")
    e.save(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == config
    again = load_file(str(tmp_path / "b" / "model.safetensors"))
    for k, v in tensors.items():
        assert again[k].dtype == v.dtype and again[k].shape == v.shape
        assert again[k].contiguous().view(torch.uint8).equal(v.contiguous().view(torch.uint8)), k
    assert (e.layers, e.ttt_steps, e.draft_vocab_size) == (d.layers, 5, 40)


def test_checkpoint_errors(tmp_path):
    d = build(_cfg(), ttt_steps=2)
    d.save(tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "ok" / "model.safetensors"))

    def variant(name, cfg=config, ts=tensors):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        save_file(ts, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        load(variant("arch", {**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="missing tensors.*norm.weight"):
        load(variant("missing", ts={k: v for k, v in tensors.items() if k != "norm.weight"}))
    with pytest.raises(ValueError, match="fc.weight has shape"):
        load(variant("shape", ts={**tensors, "fc.weight": tensors["fc.weight"][:, :-1].contiguous()}))
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nowhere")
    # a public checkpoint that carries embed_tokens loads (it is ignored)
    load(variant("embed", ts={**tensors, "embed_tokens.weight": torch.zeros(48, 32)}))


def test_vocab_map_rule():
    counts = torch.tensor([5, 0, 7, 7, 1, 5, 3, 0, 9, 5])
    d2t, t2d = vocab_map(10, 5, counts)
    # top 5 by count, ties towards the smaller id: 8 (9), 2, 3 (7), 0, 5 (5); id 9 (5) loses the tie
    used = [0, 2, 3, 5, 8]
    assert d2t.tolist() == [u - i for i, u in enumerate(used)]
    assert t2d.tolist() == [i in used for i in range(10)]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    d2t, t2d = vocab_map(10)
    assert d2t.tolist() == [0] * 10 and t2d.all()
    with pytest.raises(ValueError, match="token_counts"):
        vocab_map(10, 5)
    d = build(_cfg(vocab=10, hidden=32), draft_vocab_size=5, token_counts=counts)
    assert d.used_ids().tolist() == used


def test_default_layers_and_options():
    assert default_layers(32) == [1, 15, 28]
    assert default_layers(8) == [1, 3, 4]
    assert default_layers(4) == [0, 1]
    assert default_layers(2) == [0, 1]
    assert default_layers(1) == [0]
    d = build(_cfg(), layers=[3, 0], num_attention_heads=2)
    assert d.feature_layers == (3, 0) and d.fc.weight.shape == (32, 64)
    assert d.config.head_dim == 16 and d.config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="layers"):
        build(_cfg(), layers=[4])
    with pytest.raises(ValueError, match="hidden_size"):
        build(_cfg(), hidden_size=64)
    with pytest.raises(ValueError, match="unknown"):
        build(_cfg(), num_layers=2)
    with pytest.raises(RuntimeError, match="bind_target"):
        build(_cfg()).begin(torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]),
                            {0: torch.zeros(1, 2, 32), 1: torch.zeros(1, 2, 32)}, max_len=8)


def test_checkpoint_against_a_mismatched_target(tmp_path):
    """A saved draft loaded for another target: each mismatch is named, never silently bound."""
    from codraft.drafts import init_draft, load_draft
    target = Transformer(_cfg())
    init_draft("eagle3", target).save(tmp_path / "d")  # taps default_layers(4) == [0, 1]
    with pytest.raises(ValueError, match=r"taps layers \[0, 1\], target has 1 layers"):
        init_draft("eagle3", Transformer(_cfg(layers=1)), init=tmp_path / "d")
    with pytest.raises(ValueError, match=r"hidden_size=32, vocab_size=48; target has 64, 48"):
        load_draft(tmp_path / "d", Transformer(_cfg(hidden=64)))
    with pytest.raises(ValueError, match=r"hidden_size=32, vocab_size=48; target has 32, 60"):
        load_draft(tmp_path / "d", Transformer(_cfg(vocab=60)))
    with pytest.raises(ValueError, match=r"holds a eagle3 draft, not dflash"):
        init_draft("dflash", target, init=tmp_path / "d")
