"""The fused decode ops in C (codraft.kernels.decode_ops) against torch's ops in fp64, and a model's
KV-cache decode with them (``codraft.kernels.enable``) against the same decode on the plain model."""
import copy

import pytest
import torch
import torch.nn.functional as F

from codraft import kernels
from codraft.attention import cache_causal_mask
from codraft.kernels import decode_ops
from codraft.models import ModelConfig, Transformer
from codraft.models.kv_cache import KVCache
from codraft.models.layers import apply_rope, rope_cos_sin


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


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("d", [16, 12])  # 12: not a multiple of the 8-wide vectors
def test_cache_attention_matches_torch(t, d):
    """Rows at different lengths (one empty), grouped-query heads, several new tokens per row
    (speculative verify): outputs, written slots, and every other slot left as it was."""
    g = torch.Generator().manual_seed(1)
    b, h, hkv, L = 3, 6, 2, 24
    lengths = torch.tensor([0, 5, 12])
    q = torch.randn(b, t, h, d, generator=g)
    k, v = torch.randn(b, t, hkv, d, generator=g), torch.randn(b, t, hkv, d, generator=g)
    cos, sin = rope_cos_sin(1.0 / 100 ** (torch.arange(0, d, 2) / d), lengths[:, None] + torch.arange(t), torch.float32)
    kc, vc = torch.randn(b, hkv, L, d, generator=g), torch.randn(b, hkv, L, d, generator=g)
    ref, ref_kc, ref_vc = _reference(q, k, v, cos, sin, kc, vc, lengths)
    out = decode_ops.cache_attention(q, k, v, cos, sin, kc, vc, lengths)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, ref_kc.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(vc, ref_vc.float())  # values are copied, not computed


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
    """Prefill of right-padded prompts (into the empty cache: SDPA, not the C attention), then
    decode steps of 1 and 3 tokens per row (whole layers in C; per-op with Qwen3's q/k norms),
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

    calls = {"cache_attention": 0, "decoder_layer": 0}
    for name in calls:
        real = getattr(decode_ops, name)
        monkeypatch.setattr(decode_ops, name, lambda *a, _n=name, _f=real: calls.update({_n: calls[_n] + 1}) or _f(*a))
    fast, fast_cache = run(model)
    layers = cfg.num_hidden_layers
    assert calls == ({"cache_attention": 3 * layers, "decoder_layer": 0} if qk_norm else
                     {"cache_attention": 0, "decoder_layer": 3 * layers})  # the C paths ran
    ran = dict(calls)
    slow, slow_cache = run(plain)
    assert calls == ran  # the plain model stays plain
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    n = int(fast_cache.lengths.max())
    torch.testing.assert_close(fast_cache.k[..., :n, :], slow_cache.k[..., :n, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.v[..., :n, :], slow_cache.v[..., :n, :], rtol=1e-5, atol=1e-5)
