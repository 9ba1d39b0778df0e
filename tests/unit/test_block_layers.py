"""A block draft's round in C against the torch code on the plain draft: its decode in one call
(``codraft.kernels.block_layers``; the hidden states of a proposal's block and the context cache after
the block's write, for rows at different context lengths, fp32 and bf16 projection weights, one and two
layers), its commit in one call, DSpark's Markov loop (``codraft.kernels.markov``; the same tokens for a
seed, at this CPU's vector width and at 8 lanes), and plain steps' commits waiting for the next
proposal."""
import copy
import ctypes

import pytest
import torch

from codraft import kernels
from codraft.drafts import dspark
from codraft.kernels import block_layers, decode_ops, dispatch, markov
from codraft.models.config import ModelConfig
from codraft.models.transformer import Transformer
from codraft.spec.sampling import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(layers: int, dtype: torch.dtype, kv_heads: int = 2):
    """A target, a DSpark draft for it with random norms and weights larger than the init's (every term
    matters beside the residual), and the draft's kernel-enabled twin."""
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=16, rope_theta=1000.0,
                      architectures=["Qwen3ForCausalLM"], max_position_embeddings=256)
    torch.manual_seed(0)
    target = Transformer(cfg).eval()
    draft = dspark.build(cfg, num_layers=layers, block_size=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.3 * torch.randn(p.shape, generator=g))
    for layer in draft.layers:
        for m in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(m, torch.nn.Linear):
                m.to(dtype)
    draft.bind_target(target.embed_tokens.weight, target.head_weight).eval().requires_grad_(False)
    fast = kernels.enable(copy.deepcopy(draft)).bind_target(target.embed_tokens.weight, target.head_weight)
    return target, draft, fast


def _state(target, draft, lengths, max_len=24):
    ids = torch.randint(0, 61, (len(lengths), 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, feats = target(ids, taps=draft.feature_layers)
        return draft.begin(ids, lengths, feats, max_len=max_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers,lengths,slots", [(1, [9], 4), (1, [3, 16, 9], 4), (2, [7, 12], 3),
                                                  (2, [1, 5, 10, 16], 6)])
def test_one_call_equals_per_op_decode(monkeypatch, dtype, layers, lengths, slots):
    target, draft, fast = _pair(layers, dtype)
    calls = []
    real = decode_ops.decoder_stack
    monkeypatch.setattr(decode_ops, "decoder_stack", lambda *a, **k: calls.append(k) or real(*a, **k))
    lengths = torch.tensor(lengths)
    want_state, got_state = _state(target, draft, lengths), _state(target, draft, lengths)
    with torch.no_grad(), dispatch.forcing({"block-layer": "fused"}):
        want = draft.decode_hidden(want_state, slots, context_len=int(lengths.max()))
        got = fast.decode_hidden(got_state, slots, context_len=int(lengths.max()))
    assert calls == [{"block": True}]  # the whole run of layers in one call, block attention
    assert want.abs().max() > 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in ((got_state.k, want_state.k), (got_state.v, want_state.v)):  # the block's K/V written alike
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_the_measured_path_is_followed(monkeypatch):
    """Where the table picks the per-op decode, no C call; a table measured here times both paths."""
    target, draft, fast = _pair(1, torch.float32)
    calls = []
    real = decode_ops.decoder_stack
    monkeypatch.setattr(decode_ops, "decoder_stack", lambda *a, **k: calls.append(k) or real(*a, **k))
    state = _state(target, draft, torch.tensor([5, 8]))
    with torch.no_grad(), dispatch.forcing({"block-layer": "unfused"}):
        fast.decode_hidden(state, 4, context_len=8)
    assert calls == []
    times = dispatch.measure(block_layers._candidates(fast.layers[0]), grid=(1, 8))
    assert all(set(t) == {"fused", "unfused"} and all(0 < s < 1 for s in t.values()) for t in times.values())



def test_timing_holds_one_ring_of_caches_for_every_row_count(monkeypatch):
    """As the target's layers (test_dispatch): every row count's candidates live through a measurement,
    and each timed call, fused or per-op, writes into the next slot of one ring of caches (a cache per
    row count with a layer per copy held ~10 GB for a tiny draft layer)."""
    _, _, fast = _pair(1, torch.float32)
    rings, seen, ring_type = [], [], dispatch.KVRing
    monkeypatch.setattr(dispatch, "KVRing", lambda *a: rings.append(ring_type(*a)) or rings[-1])
    real_stack, layer_type = decode_ops.decoder_stack, type(fast.layers[0])
    real_decode = layer_type.decode
    monkeypatch.setattr(decode_ops, "decoder_stack", lambda model, first, layers, x, cos, sin, cache, **k: seen.append(
        (x.shape[0], cache.k[first])) or real_stack(model, first, layers, x, cos, sin, cache, **k))
    monkeypatch.setattr(layer_type, "decode", lambda self, x, cos, sin, k, *a: seen.append(
        (x.shape[0], k)) or real_decode(self, x, cos, sin, k, *a))
    candidates = block_layers._candidates(fast.layers[0])
    runs = {m: [run for at in candidates.values() if (run := at(m)) is not None] for m in dispatch.GRID}
    (ring,) = rings
    for m in (1, 7, 128):
        for run in runs[m] * 2:
            run()
    k0, slot_bytes = ring.k.data_ptr(), ring.k[0].nbytes
    assert len(seen) == 12 and all(len(r) == 2 for r in runs.values())
    assert all(k0 <= k.data_ptr() and k.data_ptr() + k.nbytes <= k0 + ring.k.nbytes and k.shape[0] == m
               for m, k in seen)
    slots = [(k.data_ptr() - k0) // slot_bytes for _, k in seen]
    assert all(a != b for a, b in zip(slots, slots[1:]))

@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=0.0)],
                         ids=["t1", "t0.6", "greedy"])
@pytest.mark.parametrize("rows,gamma,vocab", [(1, 4, 0), (3, 2, 0), (5, 6, 24)])
def test_markov_loop_in_c_equals_torch(monkeypatch, settings, rows, gamma, vocab):
    """DSpark's proposal with the Markov loop in C against the torch loop, same block hidden states and
    seed: the same tokens and the same q (the distribution each was drawn from), with and without a
    draft vocabulary (its out-of-vocabulary W1 row as the first previous token)."""
    target, draft, fast = _pair(1, torch.float32)
    if vocab:
        draft = dspark.build(target.config, block_size=4, draft_vocab_size=vocab)
        with torch.no_grad():
            draft.markov_head.w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        draft.bind_target(target.embed_tokens.weight, target.head_weight).eval().requires_grad_(False)
        draft.set_vocabulary(torch.randperm(61, generator=torch.Generator().manual_seed(5))[:vocab])
        fast = kernels.enable(copy.deepcopy(draft)).bind_target(target.embed_tokens.weight, target.head_weight)
    calls = []
    real = fast.fused_markov
    fast.fused_markov = lambda *a: calls.append(1) or real(*a)
    lengths = torch.arange(rows) * 3 + 4
    sides = {}
    for name, d in (("torch", draft), ("c", fast)):
        state = _state(target, d, lengths)
        sampler = Sampler(**settings, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            sides[name] = d.propose(state, gamma, sampler, context_len=int(lengths.max()))
    assert calls == [1]
    (want_x, want_q), (got_x, got_q) = sides["torch"], sides["c"]
    assert got_x.shape == (rows, gamma) and torch.equal(got_x, want_x)
    if settings["temperature"] == 0:
        assert got_q is None and want_q is None
    else:
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-7)
        assert (got_q.gather(-1, got_x[..., None]) > 0).all()


@pytest.fixture(scope="module")
def portable(portable_kernels):
    """The kernels built with 8-lane vectors (what AVX2 machines build; this one may build 16)."""
    return ctypes.CDLL(str(portable_kernels))


@pytest.mark.parametrize("lanes", [None, 8])
@pytest.mark.parametrize("k,r", [(300, 20), (64, 16), (37, 72)])
def test_markov_loop_shapes_and_vector_widths(portable, lanes, k, r):
    """The C loop at this CPU's vector width and at the portable one (8 lanes, what AVX2 machines build)
    against the loop written out in torch, for vocabularies that are not whole tiles and ranks that are
    not whole vectors (the padded last vector of a row)."""
    g = torch.Generator().manual_seed(k + r)
    b, gamma = 3, 4
    base, w1, w2 = (torch.randn(*shape, generator=g) for shape in ((b, gamma, k), (k + 1, r), (k, r)))
    prev = torch.tensor([k, 0, 5])  # k: the out-of-vocabulary row
    u = torch.rand(b, gamma, generator=g, dtype=torch.float64)
    fn = markov._kernel() if lanes is None else portable.markov_propose
    for temperature in (0.0, 0.8):
        q, tokens, scratch = torch.zeros(b, gamma, k), torch.empty(b, gamma, dtype=torch.int64), torch.empty(b * k)
        fn(*(ctypes.c_void_p(t.data_ptr()) for t in (base, w1, w2, prev, u)), ctypes.c_float(temperature),
           *(ctypes.c_void_p(t.data_ptr()) for t in (q, tokens, scratch)), *map(ctypes.c_int64, (b, gamma, k, r)))
        last = prev
        for j in range(gamma):
            z = base[:, j].double() + w1[last].double() @ w2.double().T
            if temperature == 0:
                want = z.argmax(-1)
            else:
                want_q = (z / temperature).softmax(-1)
                torch.testing.assert_close(q[:, j].double(), want_q, rtol=1e-4, atol=1e-7)
                cdf = q[:, j].double().cumsum(-1)
                want = torch.searchsorted(cdf, u[:, j, None] * cdf[:, -1:], right=True)[:, 0]
            assert torch.equal(tokens[:, j], want), (temperature, j)
            last = tokens[:, j]


@pytest.mark.parametrize("layers,lengths,new,max_len,kv_heads", [(1, [9], 5, 24, 2), (2, [3, 16, 9], 3, 24, 1),
                                                                  (2, [7, 16], 5, 14, 2)])
def test_commit_in_one_call_equals_per_op(layers, lengths, new, max_len, kv_heads):
    """A commit's context K/V (the taps' fc, the hidden norm, every layer's k/v projections, k norm and
    RoPE) written by one C call equal the per-op commit's, rows at different lengths and accepted
    counts; max_len 14: the last rows' junk slots fall past the buffer (the C code skips them, the
    per-op commit clamps them to its last position, which holds no context). One KV head: keys and
    values narrower than the hidden size."""
    target, draft, fast = _pair(layers, torch.float32, kv_heads)
    calls = []
    real = fast.fused_commit
    fast.fused_commit = lambda *a: (r := real(*a), calls.append(r))[0]
    lengths = torch.tensor(lengths)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 61, (len(lengths), new), generator=g)
    counts = torch.randint(1, new + 1, (len(lengths),), generator=g)
    feats = {l: torch.randn(len(lengths), new, 48, generator=g) for l in draft.feature_layers}
    states = {}
    with torch.no_grad(), dispatch.forcing({"block-layer": "fused"}):
        for name, d in (("per-op", draft), ("c", fast)):
            states[name] = d.commit(_state(target, d, lengths, max_len=max_len), tokens, counts, feats)
    assert calls == [True]
    want, got = states["per-op"], states["c"]
    assert torch.equal(got.ctx_len, want.ctx_len) and torch.equal(got.pending, want.pending)
    m = want.k.shape[3] - 1  # (the per-op commit's clamped junk)
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert b[..., :m, :].abs().max() > 1
        torch.testing.assert_close(a[..., :m, :], b[..., :m, :], rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    with torch.no_grad(), dispatch.forcing({"block-layer": "unfused"}):  # the measured path is followed
        fast.commit(_state(target, fast, lengths, max_len=max_len), tokens, counts, feats)
    assert calls == [True, False]


@pytest.mark.parametrize("fused", [False, True])
def test_plain_steps_commit_when_drafting_resumes(fused):
    """Plain steps' one-token commits wait in the state and are written in one call before the next
    proposal: the proposal, and the cache it leaves, equal those after writing every commit at once;
    a row dropped in between drops its waiting features."""
    target, draft, fast = _pair(2, torch.float32)
    d = fast if fused else draft
    lengths = torch.tensor([6, 9, 4])
    g = torch.Generator().manual_seed(8)
    steps = [(torch.randint(0, 61, (3, 1), generator=g), {l: torch.randn(3, 1, 48, generator=g)
                                                         for l in d.feature_layers}) for _ in range(5)]
    rows = torch.arange(3)
    with torch.no_grad(), dispatch.forcing({"block-layer": "fused"}):
        lazy, eager = _state(target, d, lengths), _state(target, d, lengths)
        for i, (tok, feats) in enumerate(steps):
            tok, feats = tok[rows], {l: f[rows] for l, f in feats.items()}
            lazy = d.commit(lazy, tok, torch.ones_like(rows), feats)
            eager = d.write_context(eager, torch.cat([feats[l] for l in d.feature_layers], -1), eager.ctx_len) or \
                eager._replace(ctx_len=eager.ctx_len + 1, pending=tok[:, 0])
            if i == 2:  # row 1 finishes
                keep = torch.tensor([0, 2])
                lazy, eager, rows = d.select(lazy, keep), d.select(eager, keep), rows[keep]
        assert len(lazy.deferred) == 5 and not eager.deferred
        assert not torch.equal(lazy.k, eager.k)  # nothing written yet
        sampler = Sampler(1.0, generator=torch.Generator().manual_seed(9))
        got = d.propose(lazy, 3, sampler, context_len=int(lazy.ctx_len.max()) + 1)
        sampler = Sampler(1.0, generator=torch.Generator().manual_seed(9))
        want = d.propose(eager, 3, sampler, context_len=int(eager.ctx_len.max()) + 1)
    assert not lazy.deferred  # written, in the state the caller holds
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lazy.k, eager.k, rtol=1e-5, atol=1e-5)
