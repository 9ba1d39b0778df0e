"""Per-sequence (varlen) attention for the packed layout against the dense T×T mask (the reference)."""
import pytest
import torch

from codraft.attention import PackedCausal, sdpa, varlen_attention, varlen_causal_mask
from codraft.models import ModelConfig, Transformer

LENS = [5, 11, 1, 0, 7]  # a length-1 and an empty sequence
PAD = 3  # padding tail after cu_seqlens[-1]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())


def test_descriptor_dense_is_the_varlen_mask():
    cu = _cu(LENS)
    m = PackedCausal.of(cu, sum(LENS) + PAD)
    assert m.bounds == tuple(cu.tolist())
    assert torch.equal(m.dense(), varlen_causal_mask(cu, sum(LENS) + PAD))
    with pytest.raises(ValueError):
        PackedCausal.of(torch.tensor([0, 5, 3]), 8)
    with pytest.raises(ValueError):
        PackedCausal.of(torch.tensor([0, 9]), 8)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("pad", [0, PAD])
def test_varlen_equals_dense_outputs_and_grads(heads, kv_heads, pad):
    torch.manual_seed(0)
    t = sum(LENS) + pad
    q = torch.randn(1, heads, t, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, t, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, t, 8, dtype=torch.float64, requires_grad=True)
    mask = PackedCausal.of(_cu(LENS), t)
    do = torch.randn(1, heads, t, 8, dtype=torch.float64)
    outs, grads = [], []
    for fn, m in [(varlen_attention, mask), (sdpa, mask.dense()), (sdpa, mask)]:
        o = fn(q, k, v, m)
        outs.append(o)
        grads.append(torch.autograd.grad(o, (q, k, v), do))
    for o, g in zip(outs[1:], grads[1:]):
        assert (o - outs[0]).abs().max() < 1e-12
        for a, b in zip(g, grads[0]):
            assert (a - b).abs().max() < 1e-12


def test_other_masks_pass_through_to_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.rand(2, 1, 6, 9) > 0.3
    mask[..., 0] = True
    assert torch.equal(varlen_attention(q, k, v, mask), sdpa(q, k, v, mask))
    assert torch.equal(varlen_attention(q, k[:, :, :6], v[:, :, :6], None), sdpa(q, k[:, :, :6], v[:, :, :6]))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_model_packed_forward_and_every_gradient_equal_dense_mask(arch):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, architectures=[arch])  # GQA
    fast = Transformer(cfg).double()
    assert fast.attention is varlen_attention  # the default for the packed layout
    ref = Transformer(cfg, attention=sdpa).double()
    ref.load_state_dict(fast.state_dict())
    t = sum(LENS) + PAD
    ids = torch.randint(0, 61, (1, t))
    cu = _cu(LENS)
    w = torch.randn(1, t, 61, dtype=torch.float64)  # a loss that reads every row, padding included
    results = []
    for model in (fast, ref):
        logits, taps = model(ids, cu_seqlens=cu, taps=(0, 2))
        ((logits * w).sum() + taps[0].sum()).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (lf, gf), (lr, gr) = results
    assert (lf - lr).abs().max() < 1e-10
    assert gf.keys() == gr.keys()
    for n in gf:
        assert (gf[n] - gr[n]).abs().max() < 1e-10, n
