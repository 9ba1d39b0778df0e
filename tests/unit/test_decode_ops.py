"""The fused decode ops in C (codraft.kernels.decode_ops) against torch's ops in fp64 (a whole decoder
layer with fp32 or bf16 projection weights, and when it applies), and a model's KV-cache decode with
them (``codraft.kernels.enable``) against the same decode on the plain model."""
import copy
import ctypes

import pytest
import torch
import torch.nn.functional as F

from codraft import kernels
from codraft.attention import cache_causal_mask
from codraft.kernels import amx, decode_ops, dispatch, fast_layers
from codraft.models import ModelConfig, Transformer
from codraft.models.kv_cache import KVCache
from codraft.models.layers import Linear, apply_rope, rope_cos_sin
from codraft.models.transformer import DecoderLayer


def _always(path: str) -> dispatch.Table:
    return dispatch.Table(ranges=((1, 128, path),), by_rows=("unfused",) + (path,) * 128, times={})


_ALWAYS_FUSED = _always("fused")


@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 17), (2, 8)])
def test_rms_norm_matches_torch(shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
    ref = w.double() * F.rms_norm(x.double(), (shape[-1],), eps=1e-5)
    torch.testing.assert_close(decode_ops.rms_norm(x, w, 1e-5), ref.float(), rtol=1e-5, atol=1e-6)


def _reference(q, k, v, cos, sin, kc, vc, lengths):
    """Torch in fp64: rope, scatter into a copy of the cache, SDPA under the cache's causal mask."""
    b, t, h, d = q.shape
    q, k = (apply_rope(x.double().transpose(1, 2), cos.double(), sin.double()) for x in (q, k))
    kc, vc = kc.double().clone(), vc.double().clone()
    pos = lengths[:, None] + torch.arange(t)
    idx = pos[:, None, :, None].expand(b, k.shape[1], t, d)
    kc.scatter_(2, idx, k)
    vc.scatter_(2, idx, v.double().transpose(1, 2))
    span = int(pos.max()) + 1
    mask = cache_causal_mask(lengths, t, span)
    out = F.scaled_dot_product_attention(q, kc[:, :, :span], vc[:, :, :span], attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2), kc, vc


def _attention_case(t, d, lengths, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    b, h, hkv = len(lengths), 6, 2
    q = torch.randn(b, t, h, d, generator=g)
    k, v = torch.randn(b, t, hkv, d, generator=g), torch.randn(b, t, hkv, d, generator=g)
    cos, sin = rope_cos_sin(1.0 / 100 ** (torch.arange(0, d, 2) / d), lengths[:, None] + torch.arange(t), torch.float32)
    kc, vc = torch.randn(b, hkv, L, d, generator=g), torch.randn(b, hkv, L, d, generator=g)
    return q, k, v, cos, sin, kc, vc


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("d", [16, 12, 64, 72])  # 12, 72: not multiples of the 8/16-wide vectors
@pytest.mark.parametrize("lengths,L", [([0, 5, 12], 24), ([3, 17, 37], 48)])  # keys: < one block .. 2 + a tail
def test_cache_attention_matches_torch(t, d, lengths, L):
    """Rows at different lengths (one empty), grouped-query heads, several new tokens per row
    (speculative verify): outputs, written slots, and every other slot left as it was."""
    lengths = torch.tensor(lengths)
    q, k, v, cos, sin, kc, vc = _attention_case(t, d, lengths, L)
    ref, ref_kc, ref_vc = _reference(q, k, v, cos, sin, kc, vc, lengths)
    out = decode_ops.cache_attention(q, k, v, cos, sin, kc, vc, lengths)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, ref_kc.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(vc, ref_vc.float())  # values are copied, not computed


def test_cache_attention_softmax_weights_are_exact_to_a_few_ulp():
    """One-hot values make the output the softmax weights themselves: the exponentials (a vectorised
    polynomial in C) within ~1e-6 of fp64, scores spread over a few units (fp32 scores: ~3e-7)."""
    d, n = 64, 64
    lengths = torch.tensor([n - 1])
    q, k, _, cos, sin, kc, vc = _attention_case(1, d, lengths, n, seed=3)
    q = q * 0.4
    vc[0, :, : n - 1] = torch.eye(d)[: n - 1]  # cached key j carries value e_j, the new one e_{n-1}
    v = torch.eye(d)[n - 1].expand(1, 1, 2, d).contiguous()
    ref, _, _ = _reference(q, k, v, cos, sin, kc, vc, lengths)
    out = decode_ops.cache_attention(q, k, v, cos, sin, kc, vc, lengths)
    assert ref.min() > 1e-3 and ref.max() < 0.2  # weights spread: exp over a range of arguments
    torch.testing.assert_close(out.double(), ref, rtol=1.5e-6, atol=0)


@pytest.mark.parametrize("d", [64, 12])
def test_cache_attention_at_the_portable_vector_width(portable_kernels, d):
    """decode_ops.c built with 8 lanes (what AVX2 machines get; this one may build 16) agrees too."""
    lib = ctypes.CDLL(str(portable_kernels))
    lengths = torch.tensor([3, 17, 37])
    q, k, v, cos, sin, kc, vc = _attention_case(3, d, lengths, 48, seed=2)
    ref, ref_kc, _ = _reference(q, k, v, cos, sin, kc, vc, lengths)
    out = torch.empty_like(q)
    b, t, h, _ = q.shape
    ptrs = (x.data_ptr() for x in (q, k, v, cos, sin, kc, vc, lengths, out))
    lib.decode_attention(*map(ctypes.c_void_p, ptrs), *map(ctypes.c_int64, (b, t, h, k.shape[2], d, 48)),
                         ctypes.c_float(d ** -0.5), None, None, ctypes.c_float(0.0), ctypes.c_int(0))
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, ref_kc.float(), rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_overflow_are_refused_before_any_write():
    kc = vc = torch.zeros(1, 1, 4, 8)
    q = k = v = torch.zeros(1, 2, 1, 8)
    cos = sin = torch.zeros(1, 1, 2, 8)
    with pytest.raises(ValueError, match="KV cache overflow: 3 \\+ 2 new tokens > 4 slots"):
        decode_ops.cache_attention(q, k, v, cos, sin, kc, vc, torch.tensor([3]))
    with pytest.raises(ValueError, match="do not fit"):  # a cache for 2 rows, 1 given
        decode_ops.cache_attention(q, k, v, cos, sin, torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8),
                                   torch.tensor([0]))
    with pytest.raises(ValueError, match="do not fit"):  # k with another head size than q
        decode_ops.cache_attention(q, torch.zeros(1, 2, 1, 4), v, cos, sin, kc, vc, torch.tensor([0]))
    with pytest.raises(ValueError, match="does not match"):
        decode_ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5)
    assert not kc.any()


def test_not_under_autograd():
    x, w = torch.randn(2, 8), torch.randn(8, requires_grad=True)
    assert not decode_ops.applies(x, w)
    with torch.no_grad():
        assert decode_ops.applies(x, w)
    assert not decode_ops.applies(x.double(), w.detach().double())


@pytest.mark.parametrize("qk_norm", [False, True])
def test_model_decode_matches_torch_ops(monkeypatch, qk_norm):
    """Prefill of right-padded prompts, then decode steps of 1 and 3 tokens per row (C attention, in
    the one-call layer or on its own as the measured dispatch picks; with Qwen3's q/k norms too),
    against the same on the plain model (C kernels not enabled): logits and caches agree."""
    cfg = ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2,
                      architectures=["Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"])
    torch.manual_seed(0)
    plain = Transformer(cfg).eval()
    model = kernels.enable(copy.deepcopy(plain))
    ids = torch.randint(0, 50, (2, 9))
    steps = [torch.randint(0, 50, (2, 1)), torch.randint(0, 50, (2, 3)), torch.randint(0, 50, (2, 1))]

    def run(model):
        cache = KVCache.for_model(model, 2, 16)
        with torch.inference_mode():
            outs = [model(ids, cache=cache)]
            cache.set_lengths(torch.tensor([4, 9]), span=9)  # row 0's prompt was 4 tokens
            outs += [model(s, cache=cache) for s in steps]
        return outs, cache

    calls = {"cache_attention": 0, "decoder_stack": 0}
    for name in calls:
        real = getattr(decode_ops, name)
        monkeypatch.setattr(decode_ops, name,
                            lambda *a, _n=name, _f=real, **k: calls.update({_n: calls[_n] + 1}) or _f(*a, **k))
    fast, fast_cache = run(model)
    layers = cfg.num_hidden_layers
    # every decode step in C (per op, or the whole stack in one call); the prefill may be too
    assert calls["cache_attention"] + layers * calls["decoder_stack"] >= 3 * layers
    ran = dict(calls)
    slow, slow_cache = run(plain)
    assert calls == ran  # the plain model stays plain
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    n = int(fast_cache.lengths.max())
    torch.testing.assert_close(fast_cache.k[..., :n, :], slow_cache.k[..., :n, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.v[..., :n, :], slow_cache.v[..., :n, :], rtol=1e-5, atol=1e-5)


def _projections(layer):
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def _bf16_weights(layer):
    """The layer with its 7 projection weights in bf16 (rollout weights); norms stay fp32."""
    for lin in _projections(layer):
        lin.to(torch.bfloat16)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,t,arch", [(1, 1, "Llama"), (3, 1, "Llama"), (2, 3, "Llama"), (1, 16, "Llama"),
                                      (4, 5, "Llama"), (8, 8, "Llama"), (2, 32, "Llama"),  # up to 64 rows
                                      (1, 1, "Qwen3"), (2, 3, "Qwen3"), (8, 8, "Qwen3")])  # q/k norms
def test_decoder_layer_matches_torch(dtype, b, t, arch):
    """One C call against the torch layer in fp64 whose weights are the same values (bf16 upcast):
    output and the KV cache after the write, for rows at different cache lengths."""
    # 72 and 100: not multiples of the kernel's vector blocks (the tails run); head size 12
    cfg = ModelConfig(vocab_size=50, hidden_size=72, intermediate_size=100, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=2, architectures=[f"{arch}ForCausalLM"])
    torch.manual_seed(b * 100 + t)
    model = Transformer(cfg).eval()
    layer = model.layers[0]
    with torch.no_grad():  # weights larger than the init's: the layer's own terms are not lost beside x
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    if dtype is torch.bfloat16:
        _bf16_weights(layer)
    ref_layer = copy.deepcopy(layer).double()  # bf16 -> fp64 is exact
    L = 48
    lengths = torch.randint(0, L - t + 1, (b,))
    if b > 1:
        lengths[0] = 0  # an empty row beside others
    fast, ref = (KVCache(num_layers=1, batch=b, max_len=L, num_kv_heads=2, head_dim=12, dtype=dt, device="cpu")
                 for dt in (torch.float32, torch.float64))
    g = torch.Generator().manual_seed(0)
    for c in (fast.k, fast.v):
        c.normal_(generator=g)
    ref.k.copy_(fast.k)
    ref.v.copy_(fast.v)
    for c in (fast, ref):
        c.set_lengths(lengths, span=int(lengths.max()))
    x = torch.randn(b, t, 72, generator=g)
    with torch.no_grad():
        ctx = model.layer_inputs(b, t, "cpu", cache=ref)  # fp32 cos, sin, mask: as the model has them
        assert decode_ops.layer_applies(layer, x, fast.k)
        y, _ = decode_ops.decoder_stack(model, 0, [layer], x, ctx.cos, ctx.sin, fast)
        mask = None if ctx.mask is None else ctx.mask.double()  # None: every row empty (b = 1), causal
        want = ref_layer(x.double(), ctx.cos.double(), ctx.sin.double(), ctx.attn, mask, ref, 0, ctx.positions,
                         ctx.span)
    # outputs of magnitude ~20: 1e-4 is a few fp32 roundings; activations rounded to bf16 would be ~1e-2 off
    assert want.abs().max() > 10
    torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fast.k, ref.k.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.v, ref.v.float(), rtol=1e-5, atol=1e-5)


def test_layer_applies():
    """Any row count; fp32 or bf16 projections (all the same); fp32 activations, cache and norms (q/k
    norms too, with the layer's eps); no autograd."""
    def config(arch):
        return ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=6, num_key_value_heads=2, architectures=[arch])
    layer, cache = DecoderLayer(config("LlamaForCausalLM")), torch.zeros(1, 4, 2, 8, 8)
    x = torch.randn(4, 50, 48)  # 200 rows: the dispatcher, not this, decides whether it pays
    bf16 = _bf16_weights(copy.deepcopy(layer))
    mixed = copy.deepcopy(layer)
    mixed.mlp.down_proj.to(torch.bfloat16)
    strided = copy.deepcopy(bf16)
    strided.self_attn.q_proj.weight.data = strided.self_attn.q_proj.weight.data.T.contiguous().T
    bf16_norm = copy.deepcopy(bf16)
    bf16_norm.input_layernorm.to(torch.bfloat16)
    qwen3 = DecoderLayer(config("Qwen3ForCausalLM"))
    assert not decode_ops.layer_applies(layer, x, cache)  # its weights need grad, autograd is on
    with torch.no_grad():
        assert decode_ops.layer_applies(layer, x, cache) and decode_ops.layer_applies(bf16, x, cache)
        assert decode_ops.layer_applies(bf16, x[:1, :1], cache)
        assert decode_ops.layer_applies(qwen3, x, cache)
        qwen3.self_attn.k_norm.eps = 1e-3  # the C code takes one eps for every norm of a layer
        assert not decode_ops.layer_applies(qwen3, x, cache)
        assert not decode_ops.layer_applies(mixed, x, cache) and not decode_ops.layer_applies(strided, x, cache)
        assert not decode_ops.layer_applies(bf16_norm, x, cache)
        assert not decode_ops.layer_applies(layer, x.double(), cache)
        assert not decode_ops.layer_applies(bf16, x, cache.double())
        assert not decode_ops.layer_applies(layer.double(), x.double(), cache.double())


def _stack_model(dtype, layers=3, seed=0, hidden=72, intermediate=100):
    """A Llama-shaped model (hidden 72, intermediate 100: vector tails run; 64 and 96 with 16-wide
    heads: shapes AMX takes) with weights larger than the init's, projections in ``dtype``; and its
    kernel-enabled twin."""
    cfg = ModelConfig(vocab_size=50, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=hidden // 12 if hidden == 72 else hidden // 16, num_key_value_heads=2)
    torch.manual_seed(seed)
    plain = Transformer(cfg).eval()
    with torch.no_grad():
        for layer in plain.layers:
            for p in layer.parameters():
                p.copy_(torch.randn_like(p) * 0.3 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
            if dtype is torch.bfloat16:
                _bf16_weights(layer)
    return plain, kernels.enable(copy.deepcopy(plain)).requires_grad_(False)  # as the rollout engine's


def _stack_run(model, x, lengths, layers: range, taps=(), seed=0):
    """``model.run_layers`` over ``layers`` on x (B,T,D) into a cache whose rows hold ``lengths``
    random keys -> (output, taps, cache)."""
    b, t, _ = x.shape
    cache = KVCache.for_model(model, b, 40)
    g = torch.Generator().manual_seed(seed)
    for c in (cache.k, cache.v):
        c.normal_(generator=g)
    cache.set_lengths(lengths, span=int(lengths.max()))
    with torch.inference_mode():
        ctx = model.layer_inputs(b, t, "cpu", cache=cache)
        y, tapped = model.run_layers(x, ctx, layers, taps)
    return y, tapped, cache


@pytest.mark.parametrize("dtype,path", [(torch.float32, "fused"), (torch.bfloat16, "fused"),
                                        (torch.bfloat16, "fused-panels"), (torch.bfloat16, "fused-amx")])
@pytest.mark.parametrize("b,t,layers", [(1, 1, range(3)), (3, 2, range(3)), (2, 1, range(1, 3)), (4, 4, range(2)),
                                        (9, 2, range(3))])  # 18 rows: two blocks of AMX tiles
def test_decoder_stack_matches_torch(monkeypatch, dtype, path, b, t, layers):
    """A run of layers in one C call (the whole stack, or a pipeline stage's part of it; bf16 products
    on the vector kernel or on AMX tiles, of shapes AMX takes) against the plain model's torch layers:
    output, tapped outputs, and every layer's cache after the write. (Without AMX on this CPU the C
    code runs "fused-amx" products on the vector kernel: test_amx checks the CPU has none.)"""
    monkeypatch.setattr(fast_layers, "layer_table", lambda layer: _always(path))
    calls = []
    real = decode_ops.decoder_stack
    monkeypatch.setattr(decode_ops, "decoder_stack", lambda *a, **k: calls.append((*a[1:3], k)) or real(*a, **k))
    hidden, intermediate = (64, 96) if path == "fused-amx" else (72, 100)
    plain, fast = _stack_model(dtype, hidden=hidden, intermediate=intermediate)
    if path == "fused-amx":
        assert fast_layers._amx_fits(fast.layers[0]) == amx.ready()
    x = torch.randn(b, t, hidden, generator=torch.Generator().manual_seed(1))
    lengths = torch.randint(0, 30, (b,), generator=torch.Generator().manual_seed(2))
    taps = (layers.start, layers.stop - 1, 7)  # 7: not in the run, ignored
    y, tapped, cache = _stack_run(fast, x, lengths, layers, taps)
    assert len(calls) == 1 and calls[0][0] == layers.start and len(calls[0][1]) == len(layers)
    assert calls[0][2]["amx"] == (path == "fused-amx") and calls[0][2]["panels"] == (path == "fused-panels")
    want, want_tapped, want_cache = _stack_run(plain, x, lengths, layers, taps)
    assert want.abs().max() > 10  # the layers' own terms are not lost beside x
    # fp32 sums in another order (the kernel's accumulators, per tuning): errors scale with the
    # residual stream's magnitude (up to ~70 here), not with each element's
    atol = 1e-5 * float(want.abs().max())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=atol)
    assert tapped.keys() == want_tapped.keys() == {layers.start, layers.stop - 1}
    for i in tapped:
        torch.testing.assert_close(tapped[i], want_tapped[i], rtol=1e-5, atol=atol)
    for got, ref in ((cache.k, want_cache.k), (cache.v, want_cache.v)):  # (from the same sums, normed)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.abs().max())))


@pytest.mark.parametrize("dtype,path", [(torch.float32, "fused"), (torch.bfloat16, "fused-panels")])
def test_decoder_stack_follows_changed_weights(monkeypatch, dtype, path):
    """The stack keeps the weights' addresses (and bf16 copies packed in panels) between steps: weights
    updated in place (an optimiser step, a rollout refresh), swapped for new tensors (``.data =``) or
    in a replaced module are all what the next call reads."""
    monkeypatch.setattr(fast_layers, "layer_table", lambda layer: _always(path))
    plain, fast = _stack_model(dtype)
    x, lengths = torch.randn(2, 1, 72), torch.tensor([3, 9])

    def same():
        torch.testing.assert_close(_stack_run(fast, x, lengths, range(3))[0],
                                   _stack_run(plain, x, lengths, range(3))[0], rtol=1e-5, atol=1e-4)
    same()
    with torch.no_grad():
        for m in (plain, fast):
            m.layers[1].mlp.down_proj.weight.mul_(-1)  # in place
    same()
    with torch.no_grad():
        new = (torch.randn(72, 72) * 0.3).to(dtype)
        plain.layers[2].self_attn.q_proj.weight.data = new.clone()
        fast.layers[2].self_attn.q_proj.weight.data = new.clone()
    same()
    up = Linear(72, 100, bias=False, dtype=dtype).requires_grad_(False)  # (the models call their projections)
    plain.layers[0].mlp.up_proj = copy.deepcopy(up)
    fast.layers[0].mlp.up_proj = up
    same()
    plan = decode_ops._stacks[fast][(0, 3)]
    assert (plan.packed is not None) == (path == "fused-panels")  # the packed copies were what ran
    fast.requires_grad_(True)  # trainable (a fused optimiser step would not bump their versions): unpacked
    same()
    assert decode_ops._stacks[fast][(0, 3)].packed is None
    fast.requires_grad_(False)
    other = torch.float32 if dtype is torch.bfloat16 else torch.bfloat16
    for m in (plain, fast):  # one projection of another dtype: that layer runs per op, the stack not in one call
        m.layers[1].mlp.up_proj.to(other)
    ran = []
    real = decode_ops.decoder_stack
    monkeypatch.setattr(decode_ops, "decoder_stack",
                        lambda *a, **k: ran.append((len(a[2]), real(*a, **k))) or ran[-1][1])
    same()
    # the run refused; layers 0 and 2 each alone, as a run of one
    assert ran[0] == (3, None) and [n for n, _ in ran[1:]] == [1, 1]
