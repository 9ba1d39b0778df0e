"""The families users start from (Qwen2, Mistral, Gemma 2, Gemma 3 text, Phi-3) against `transformers`
(the independent oracle): random tiny configs built with transformers' own config classes and saved with
its save_pretrained, loaded by codraft. Logits (and the packed training forward, shared prefixes
included) equal transformers'; codraft's save loads back in transformers with the same logits; the KV
cache honours sliding windows shorter than prompt + generation; greedy decoding equals transformers'
greedy and speculative decoding equals plain decoding for every draft kind; the CPU kernels give the
plain path's tokens; drafts over these targets export and load back; what is not modelled is refused."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import transformers  # the [dev] extra: the independent oracle
from codraft import kernels
from codraft.attention import PackedCausal
from codraft.drafts import build_draft
from codraft.export.reader import load_exported
from codraft.export.write import export_draft
from codraft.models import KVCache, ModelConfig, load_pretrained, save_pretrained
from codraft.rollout import Engine, Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

V, W = 97, 7  # vocabulary; the sliding window, shorter than the prompts + generations below
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)
# family -> (config class, model class, the family's own settings); every window is W
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),  # Qwen2.5 / R1-Distill-Qwen: biases
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=W,
                                                             max_window_layers=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=W, head_dim=24)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    # query_pre_attn_scalar == head_dim (as Gemma 3 1B): its attention may take the C kernel
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=W, sliding_window_pattern=2,
                                                             rope_local_base_freq=100.0, query_pre_attn_scalar=16,
                                                             final_logit_softcapping=8.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=W, pad_token_id=0, eos_token_id=1)),
}
WINDOWED = ("qwen2-window", "mistral", "gemma2", "gemma3", "phi3")
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33], [9, 40, 2, 33, 7, 1, 12, 60], [4, 70, 21]]


def _hf(family: str, layers: int = 2, **override):
    cfg_name, model_name, extra = FAMILIES[family]
    # eager: transformers' reference attention (its SDPA path skips Gemma 2's logit soft-capping in some releases)
    cfg = getattr(transformers, cfg_name)(**COMMON, num_hidden_layers=layers, attn_implementation="eager",
                                          **{**extra, **override})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # HF initialises norms (Gemma's to 0) and biases to constants: random everywhere
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (HF model, its save_pretrained folder), built once per family."""
    made = {}

    def get(family: str, layers: int = 2):
        if (family, layers) not in made:
            hf = _hf(family, layers)
            path = tmp_path_factory.mktemp(family) / "hf"
            hf.save_pretrained(path)
            made[family, layers] = hf, path
        return made[family, layers]
    return get


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers(family, fast, folders):
    hf, path = folders(family)
    ours = load_pretrained(path).eval()
    assert ours.config.architectures == [FAMILIES[family][1]]
    if fast:
        kernels.enable(ours)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, taps = ours(ids, taps=(0,))
    assert _max_diff(logits, ref.logits) <= 1e-4
    assert _max_diff(taps[0], ref.hidden_states[1]) <= 1e-4
    if family in WINDOWED:  # the window changes the logits here: a model that ignored it would fail
        unwindowed = _hf(family, sliding_window=1000)  # the same weights, a window past the sequence
        with torch.no_grad():
            assert _max_diff(unwindowed(ids).logits, ref.logits) > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_training_forward_equals_transformers(family, folders):
    """The trainer's layout: one packed row with padding, and GRPO completions that see their shared
    prompt packed once (``PackedCausal.prefix``); in training mode, with a backward."""
    hf, path = folders(family)
    ours = load_pretrained(path).train()
    g = torch.Generator().manual_seed(2)
    prompt, a, b = (torch.randint(0, V, (n,), generator=g) for n in (9, 12, 5))
    row = torch.cat([prompt, a, b, torch.zeros(3, dtype=torch.long)])[None]
    cu = torch.tensor([0, 9, 21, 26])
    for layout in (PackedCausal.of(cu, 29), PackedCausal.of(cu, 29, prefix=(-1, 0, 0))):
        out = ours(row, layout=layout)
        with torch.no_grad():
            seen = layout.prefix_of(1) >= 0
            ref_p = hf(prompt[None]).logits[0]
            ref_a = hf(torch.cat([prompt, a])[None]).logits[0, 9:] if seen else hf(a[None]).logits[0]
            ref_b = hf(torch.cat([prompt, b])[None]).logits[0, 9:] if seen else hf(b[None]).logits[0]
        for got, ref in ((out[0, :9], ref_p), (out[0, 9:21], ref_a), (out[0, 21:26], ref_b)):
            assert _max_diff(got.detach(), ref) <= 1e-4
        out[0, :26].logsumexp(-1).sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())
        ours.zero_grad()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_codraft_save_loads_in_transformers(family, folders, tmp_path):
    hf, path = folders(family)
    ours = load_pretrained(path).eval()
    save_pretrained(ours, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["architectures"] == [FAMILIES[family][1]]
    again = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "ours",
                                                                       attn_implementation="eager").eval()
    assert type(again.config) is type(hf.config)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert _max_diff(again(ids).logits, ours(ids)) <= 1e-4
    back = load_pretrained(tmp_path / "ours")  # and codraft reads its own folder to the same tensors
    assert all(torch.equal(x, y) for x, y in zip(ours.state_dict().values(), back.state_dict().values()))
    assert back.config.layer_types == ours.config.layer_types


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("family", WINDOWED)
def test_kv_cache_decode_honours_the_window(family, fast, folders):
    """Right-padded prefill, then chunks of 1 and 3 tokens into the cache, past the window: every step's
    logits equal a full forward's."""
    _, path = folders(family)
    model = load_pretrained(path).eval()
    if fast:
        kernels.enable(model)
    b, total = 3, 24
    ids = torch.randint(0, V, (b, total), generator=torch.Generator().manual_seed(4))
    prompt_lens = torch.tensor([4, 9, 6])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch=b, max_len=64)
        pre = model(ids[:, :9], cache=cache, logit_index=prompt_lens - 1)
        assert _max_diff(pre[:, 0], full[torch.arange(b), prompt_lens - 1]) <= 1e-5
        cache.set_lengths(prompt_lens)
        pos = prompt_lens.clone()
        for step in range(8):
            t = 3 if step % 3 == 1 else 1
            chunk = torch.stack([ids[r, pos[r]:pos[r] + t] for r in range(b)])
            out = model(chunk, cache=cache)
            for r in range(b):
                assert _max_diff(out[r], full[r, pos[r]:pos[r] + t]) <= 1e-5
            pos += t
        assert int(pos.min()) > W


def test_plain_greedy_equals_transformers_generate(folders):
    for family in sorted(FAMILIES):
        hf, path = folders(family)
        ours = load_pretrained(path).eval()
        got = Engine(ours).generate(PROMPTS[:1], 20, temperature=0, eos_id=[])[0].tokens
        with torch.no_grad():
            ref = hf.generate(torch.tensor(PROMPTS[:1]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                              pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
        assert got == ref, family


KINDS = ("eagle3", "dflash", "dspark", "ngram", "model", "model-self")


def _draft_of(kind, target, gamma=3):
    torch.manual_seed(1)
    if kind == "model-self":
        return build_draft("model", target.config, num_hidden_layers=target.config.num_hidden_layers,
                           weights=target.state_dict(), gamma=gamma)
    opts = {"model": dict(num_hidden_layers=1), "ngram": dict(n=3)}.get(kind, {})
    return build_draft(kind, target.config, target=target, gamma=gamma, **opts)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_speculative_equals_plain_for_every_draft_kind(family, folders):
    _, path = folders(family)
    target = load_pretrained(path).eval()
    plain = Engine(target).generate(PROMPTS, 20, temperature=0, eos_id=[])
    for kind in KINDS:
        engine = Engine(target, _draft_of(kind, target), gamma=3)
        spec = engine.generate(PROMPTS, 20, temperature=0, eos_id=[])
        assert [r.tokens for r in spec] == [r.tokens for r in plain], kind
        assert max(abs(x - y) for a, b in zip(plain, spec) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4, kind
        if kind == "model-self":  # a copy of the target: every drafted token accepted
            assert engine.stats.acceptance_length == 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernel_path_gives_the_plain_paths_tokens(family, folders):
    _, path = folders(family)
    plain_model, fast_model = load_pretrained(path).eval(), kernels.enable(load_pretrained(path).eval())
    for make in (lambda t: None, lambda t: _draft_of("model", t)):
        runs = [Engine(m, d, gamma=None if d is None else 3).generate(PROMPTS, 20, temperature=0, eos_id=[])
                for m, d in ((plain_model, make(plain_model)), (fast_model, kernels.enable(make(fast_model))))]
        a, b = runs
        assert [r.tokens for r in a] == [r.tokens for r in b]
        assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs)) <= 1e-4


def test_a_window_longer_than_the_context_keeps_the_one_call_layer(folders):
    """Mistral's window reaches back over the whole cache: the kernels run its layers as Llama's; a
    shorter one (or Qwen2's biases) leaves the one-call layer for the per-op path."""
    from codraft.kernels import decode_ops
    _, path = folders("mistral")
    model = kernels.enable(load_pretrained(path).eval())
    if not kernels.available():
        pytest.skip("no C compiler: the kernels are off")
    x, layer = torch.zeros(1, 1, 64), model.layers[0]
    qwen2 = kernels.enable(load_pretrained(folders("qwen2")[1]).eval())
    with torch.no_grad():  # as decode steps run
        assert decode_ops.layer_applies(layer, x, torch.zeros(2, 1, 2, W, 24))
        assert not decode_ops.layer_applies(layer, x, torch.zeros(2, 1, 2, W + 1, 24))
        assert not decode_ops.layer_applies(qwen2.layers[0], x, torch.zeros(2, 1, 2, 8, 16))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gemma3", "phi3"])
def test_a_draft_over_the_target_exports_and_loads_back(family, kind, folders, tmp_path):
    _, path = folders(family, layers=4)  # EAGLE-3 exports three taps below the last layer
    target = load_pretrained(path).eval()
    torch.manual_seed(2)
    draft = build_draft(kind, target.config, target=target, **({"layers": [0, 1, 2]} if kind == "eagle3" else {}))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(("norm" in name) + 0.3 * torch.randn_like(p))
    draft.save(tmp_path / "src")
    learned = kind != "eagle3" and draft.config.mask_token_id is None
    e = export_draft(tmp_path / "src", tmp_path / "out", target=str(path), mask_token_id=0 if learned else None)
    back = load_exported(e.path, target)
    tokens = torch.tensor([p + [0] * (9 - len(p)) for p in PROMPTS])
    lengths = torch.tensor([len(p) for p in PROMPTS])
    with torch.no_grad():
        feats = target(tokens, taps=tuple(draft.feature_layers))[1]
        for temperature in (0.0, 1.0):
            (x0, q0), (x1, q1) = (d.propose(d.begin(tokens, lengths, feats, max_len=16), 3,
                                            Sampler(temperature, generator=torch.Generator().manual_seed(0)),
                                            context_len=9) for d in (draft, back))
            assert torch.equal(x0, x1)
            if q0 is not None:
                torch.testing.assert_close(q1, q0, rtol=1e-5, atol=1e-6)


def test_windowed_packed_attention_equals_its_dense_mask():
    """varlen_attention with a window (and a shared prefix) against SDPA over ``PackedCausal.dense()``;
    soft-capped attention per segment against the same dense mask."""
    from codraft.attention import sdpa, softcapped_attention, varlen_attention
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 30, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 9, 21, 27])
    for prefix in ((), (-1, 0, 0)):
        layout = dataclasses.replace(PackedCausal.of(cu, 30, prefix), window=5)
        torch.testing.assert_close(varlen_attention(q, k, v, layout), sdpa(q, k, v, layout.dense()),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(softcapped_attention(q, k, v, layout, 1.5),
                                   softcapped_attention(q, k, v, layout.dense(), 1.5), rtol=1e-5, atol=1e-6)
    assert layout.longest() == 9 + 12


def test_a_window_under_another_attention_is_refused(folders):
    """Context parallelism's ring attention knows no windows: refused where the window masks a key."""
    model = load_pretrained(folders("mistral")[1])
    ring = lambda q, k, v, mask: q  # noqa: E731 (stands for RingAttention)
    cu = torch.tensor([0, 5, 12])
    with pytest.raises(ValueError, match=r"sliding windows shorter than the sequence \(\[7\] < 12\)"):
        model(torch.zeros(1, 12, dtype=torch.long), cu_seqlens=torch.tensor([0, 12]), attention=ring)
    model(torch.zeros(1, 12, dtype=torch.long), cu_seqlens=cu, attention=ring)  # segments within the window: fine


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_a_model_draft_of_the_family_saves_and_loads_back(family, folders, tmp_path):
    from codraft.drafts import load_draft
    target = load_pretrained(folders(family)[1]).eval()
    draft = _draft_of("model", target)
    draft.save(tmp_path / "d")
    back = load_draft(tmp_path / "d", target)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), back.state_dict().values()))
    out = [Engine(target, d, gamma=3).generate(PROMPTS, 8, temperature=0, eos_id=[]) for d in (draft, back)]
    assert [r.tokens for r in out[0]] == [r.tokens for r in out[1]]


def _cfg(arch, **kw):
    return ModelConfig(**{**dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, architectures=[arch]), **kw})


@pytest.mark.parametrize("arch,kw,msg", [
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75), "only full rotary"),
    ("Phi3ForCausalLM", dict(rope_scaling={"rope_type": "longrope"}), "unsupported rope_scaling type 'longrope'"),
    ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), "activation 'gelu' is not modelled"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention: not modelled"),
    ("Gemma2ForCausalLM", dict(attention_bias=True), "attention_bias"),
    ("LlamaForCausalLM", dict(final_logit_softcapping=30.0), "are Gemma's"),
    ("Gemma3ForConditionalGeneration", {}, "unsupported architecture 'Gemma3ForConditionalGeneration'"),
])
def test_what_is_not_modelled_is_refused_in_one_line(arch, kw, msg):
    from codraft.models import Transformer
    with pytest.raises(ValueError, match=msg):
        Transformer(_cfg(arch, **kw))


def test_hf_config_forms_are_read():
    """transformers 4.x's config.json forms: Gemma 3's rope_local_base_freq and sliding_window_pattern,
    Qwen2's switched-off window; 5.x's per-layer-type rope_parameters."""
    c = ModelConfig.from_dict({**COMMON, "num_hidden_layers": 6, "model_type": "gemma3_text", "rope_theta": 1e6,
                               "rope_local_base_freq": 1e4, "sliding_window": 512, "sliding_window_pattern": 6,
                               "hidden_activation": "gelu_pytorch_tanh", "head_dim": 16})
    assert c.architectures == ["Gemma3ForCausalLM"] and c.rope_local_base_freq == 1e4 and c.rope_theta == 1e6
    assert [c.window(i) for i in range(6)] == [512] * 5 + [None]
    d = ModelConfig.from_dict({**COMMON, "num_hidden_layers": 2, "model_type": "gemma3_text", "head_dim": 16,
                               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
                               "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8})
    assert (d.rope_theta, d.rope_local_base_freq, d.window(0), d.window(1)) == (5e5, 50.0, None, 8)
    q = ModelConfig.from_dict({**COMMON, "num_hidden_layers": 2, "model_type": "qwen2", "sliding_window": 4096,
                               "use_sliding_window": False, "max_window_layers": 28})
    assert q.window(0) is q.window(1) is None and q.qkv_biased
    small = dataclasses.replace(d, num_hidden_layers=1)  # a model draft of fewer layers keeps the first's types
    assert small.layer_types == ["full_attention"]
