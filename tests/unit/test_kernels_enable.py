"""``codraft.kernels.enable``: a model (and drafts) with the CPU fast path installed gives the plain
model's logits over prefill + decode steps (every C path made to run by made-up dispatch timings) and
the same greedy tokens (with this machine's dispatch tables); it keeps state-dict names,
deepcopy, save/load, autograd and ``Module.to``; ``CODRAFT_KERNELS=0`` leaves every class as it is."""
import copy

import pytest
import torch

from codraft import kernels
from codraft.drafts import build_draft
from codraft.kernels import decode_ops, dispatch, products
from codraft.models import KVCache, ModelConfig, Transformer, load_pretrained, save_pretrained
from codraft.models.layers import MLP, RMSNorm
from codraft.models.transformer import Attention, DecoderLayer
from codraft.rollout import Engine

V = 61
REFERENCE = (Transformer, DecoderLayer, Attention, MLP, RMSNorm)


def _model(arch="LlamaForCausalLM", tie=False, layers=2):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                      architectures=[arch], tie_word_embeddings=tie)
    model = Transformer(cfg)
    with torch.no_grad():  # larger weights than the init: decisive argmaxes in the greedy test
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _classes(module):
    return [type(m) for m in module.modules()]


def _decode(model, batch, steps):
    """Right-padded prefill (rows of different lengths), then one step of each size in ``steps``."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, V, (batch, 9), generator=g)
    cache = KVCache.for_model(model, batch, 9 + sum(steps))
    with torch.inference_mode():
        outs = [model(ids, cache=cache)]
        cache.set_lengths(torch.arange(9 - batch + 1, 10), span=9)
        outs += [model(torch.randint(0, V, (batch, t), generator=g), cache=cache) for t in steps]
    return outs, cache


@pytest.fixture
def fused_up_to_8_rows(monkeypatch, tmp_path):
    """Dispatch tables from made-up times (a fresh cache): the one-call layer and the GEMV kernel win
    up to 8 rows, the per-op layer and (w @ xᵀ)ᵀ above, so every C path runs whatever this machine's
    timings would pick."""
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(dispatch, "TABLES", {})
    real = dispatch.measure

    def times(name, rows, run):
        wins = {"fused", "kernel"} if rows <= 8 else {"unfused", "transposed"}
        return 1.0 if name in wins else 2.0
    monkeypatch.setattr(dispatch, "measure", lambda candidates, grid=dispatch.GRID, timer=None:
                        real(candidates, grid, times))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("batch,steps", [(1, [1, 4, 16, 20]), (4, [1, 4, 5])])  # 1, 4, 16, 20 rows
def test_same_logits_as_plain(monkeypatch, fused_up_to_8_rows, arch, batch, steps):
    plain = _model(arch, tie=arch == "LlamaForCausalLM")
    fast = kernels.enable(copy.deepcopy(plain))
    assert all(type(m) not in REFERENCE for m in fast.modules() if isinstance(m, REFERENCE))
    calls = dict.fromkeys(["kernel", "transposed", "decoder_stack", "cache_attention", "rms_norm"], 0)
    runs = []  # layers per decoder_stack call

    def counted(name, fn):
        return lambda *a, **k: calls.update({name: calls[name] + 1}) or fn(*a, **k)
    for name in ("kernel", "transposed"):
        monkeypatch.setitem(products.PATHS, name, counted(name, products.PATHS[name]))
    for name in ("decoder_stack", "cache_attention", "rms_norm"):
        monkeypatch.setattr(decode_ops, name, counted(name, getattr(decode_ops, name)))
    stack = decode_ops.decoder_stack
    monkeypatch.setattr(decode_ops, "decoder_stack", lambda *a, **k: runs.append(len(a[2])) or stack(*a, **k))
    got, got_cache = _decode(fast, batch, steps)
    # the one-call layers (Qwen3's with their q/k norms) run as one call for the whole stack
    assert 0 < min(calls.values()) and set(runs) == {len(fast.layers)}
    monkeypatch.undo()
    want, want_cache = _decode(plain, batch, steps)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    n = int(want_cache.lengths.max())
    torch.testing.assert_close(got_cache.k[..., :n, :], want_cache.k[..., :n, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache.v[..., :n, :], want_cache.v[..., :n, :], rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 33, 7, 1, 12, 60], [4]]


@pytest.mark.parametrize("kind", [None, "ngram", "model", "eagle3", "dflash"])
def test_same_greedy_tokens(kind):
    plain = _model(layers=4)
    fast = kernels.enable(copy.deepcopy(plain))
    draft = fast_draft = None
    if kind is not None:
        torch.manual_seed(1)
        draft = build_draft(kind, plain.config)  # without a target: not enabled by the factory
        if hasattr(draft, "bind_target"):
            draft.bind_target(plain.embed_tokens.weight, plain.head_weight)
        fast_draft = kernels.enable(build_draft(kind, fast.config, target=fast))
        if isinstance(draft, torch.nn.Module):
            fast_draft.load_state_dict(draft.state_dict())
            assert _classes(fast_draft) != _classes(draft)  # something was swapped
        if kind == "dflash":
            assert fast_draft.product is products.linear and "product" not in vars(draft)
            assert all(layer.self_attn.product is products.linear for layer in fast_draft.layers)
    want = Engine(plain, draft, gamma=3 if draft else None).generate(PROMPTS, 24, temperature=0, eos_id=[])
    got = Engine(fast, fast_draft, gamma=3 if draft else None).generate(PROMPTS, 24, temperature=0, eos_id=[])
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4


def test_opt_out_leaves_classes(monkeypatch, fresh_kernels):
    monkeypatch.setenv("CODRAFT_KERNELS", "0")
    model = _model()
    before = _classes(model)
    assert not kernels.available() and kernels.enable(model) is model and _classes(model) == before
    draft = build_draft("dflash", model.config, target=model)
    kernels.enable(draft)
    assert "product" not in vars(draft) and all(type(m) not in kernels.SWAPS.values() for m in draft.modules())


def test_no_compiler_warns_and_leaves_classes(tmp_path, monkeypatch, fresh_kernels):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    model = _model()
    before = _classes(model)
    with pytest.warns(UserWarning, match="C kernels unavailable"):
        kernels.enable(model)
    assert _classes(model) == before


def test_enable_is_idempotent_and_keeps_module_behaviour(tmp_path):
    plain = _model("Qwen3ForCausalLM")
    fast = kernels.enable(copy.deepcopy(plain))
    classes = _classes(fast)
    assert kernels.enable(fast) is fast and _classes(fast) == classes
    assert kernels.enable(object) is object  # not a module (e.g. the n-gram draft): returned as is
    assert list(fast.state_dict()) == list(plain.state_dict())
    assert _classes(copy.deepcopy(fast)) == classes
    save_pretrained(fast, tmp_path / "m")
    back = load_pretrained(tmp_path / "m")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in fast.state_dict().items())
    ids = torch.randint(0, V, (2, 7))
    # training: the autograd path is the reference one, same loss and gradients
    for m in (plain, fast):
        m.zero_grad()
        m(ids).logsumexp(-1).mean().backward()
    for (name, p), q in zip(plain.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Module.to: another dtype falls back to the reference forward
    with torch.no_grad():
        torch.testing.assert_close(fast.to(torch.float64)(ids), plain.to(torch.float64)(ids))
