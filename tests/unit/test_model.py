"""The decoder against HF `transformers` (independent oracle), plus packing, KV cache and save/load;
the oracles for the forward and the KV-cache decode also run with the CPU kernels enabled."""
import json

import pytest
import torch

from codraft import kernels
from codraft.models import KVCache, ModelConfig, Transformer, load_pretrained, save_pretrained

import transformers  # the [dev] extra: the independent oracle


def _hf_model(arch: str, tmp_path):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
    torch.manual_seed(0)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False, rope_theta=1e6)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 5e5}
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF inits norms to 1: perturb so a missing/misnamed norm is caught
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path / arch)
    return model, tmp_path / arch


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_logits_and_taps_match_transformers(arch, fast, tmp_path):
    hf, path = _hf_model(arch, tmp_path)
    ours = load_pretrained(path)
    if fast:
        kernels.enable(ours)
    ids = torch.randint(0, 97, (2, 80))  # positions beyond original_max_position_embeddings exercise llama3 scaling
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, taps = ours(ids, taps=(0, 1, 2))
    assert (logits - ref.logits).abs().max() <= 1e-4
    for i in (0, 1, 2):
        assert (taps[i] - ref.hidden_states[i + 1]).abs().max() <= 1e-4


def _tiny(arch="LlamaForCausalLM", tie=False):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, architectures=[arch], tie_word_embeddings=tie)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_packed_equals_unpacked(arch):
    model = _tiny(arch)
    lens = [5, 11, 1, 7]
    seqs = [torch.randint(0, 61, (n,)) for n in lens]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    packed = torch.cat(seqs + [torch.zeros(3, dtype=torch.long)])[None]  # trailing padding is inert
    with torch.no_grad():
        out, taps = model(packed, cu_seqlens=cu, taps=(1,))
        for s, a in zip(seqs, cu[:-1].tolist()):
            ref, ref_taps = model(s[None], taps=(1,))
            torch.testing.assert_close(out[0, a:a + len(s)], ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(taps[1][0, a:a + len(s)], ref_taps[1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_kv_cache_decode_equals_full_forward(arch, fast):
    model = _tiny(arch)
    if fast:
        kernels.enable(model)
    b, total = 3, 20
    ids = torch.randint(0, 61, (b, total))
    prompt_lens = torch.tensor([4, 9, 6])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch=b, max_len=64)
        # right-padded batched prefill; each row then continues from its own length
        pre = model(ids[:, :9], cache=cache, logit_index=prompt_lens - 1)
        torch.testing.assert_close(pre[:, 0], full[torch.arange(b), prompt_lens - 1], rtol=1e-5, atol=1e-5)
        cache.set_lengths(prompt_lens)
        pos = prompt_lens.clone()
        for step in range(3):  # chunks of 1 and 3 tokens, as decode and verify do
            t = 1 if step != 1 else 3
            chunk = torch.stack([ids[r, pos[r]:pos[r] + t] for r in range(b)])
            out = model(chunk, cache=cache)
            for r in range(b):
                torch.testing.assert_close(out[r], full[r, pos[r]:pos[r] + t], rtol=1e-5, atol=1e-5)
            pos += t
        assert torch.equal(cache.lengths, pos)


@pytest.mark.parametrize("shard", [None, 20_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip(tmp_path, shard, dtype):
    model = _tiny("Qwen3ForCausalLM").to(dtype)
    save_pretrained(model, tmp_path / "m", max_shard_bytes=shard)
    if shard:
        assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    back = load_pretrained(tmp_path / "m", dtype=dtype)
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not list(tmp_path.glob(".m.tmp-*"))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "empty")
    model = _tiny()
    save_pretrained(model, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())

    cfg_path.write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM, Qwen3ForCausalLM"):
        load_pretrained(tmp_path / "m")

    cfg_path.write_text(json.dumps({**cfg, "intermediate_size": 81}))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight .*has shape \((48, 80|80, 48)\), expected \((48, 81|81, 48)\)"):
        load_pretrained(tmp_path / "m")

    cfg_path.write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.3"):
        load_pretrained(tmp_path / "m")

    cfg_path.write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.2"):
        load_pretrained(tmp_path / "m")

    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_pretrained(tmp_path / "m")
