"""Tokenizers: CharTokenizer round trip and specials; HFTokenizer on a tiny byte-level tokenizer
(specials, chat template via Jinja vs the ChatML fallback, plain prompts) and load_tokenizer's
vocab-size check against config.json. No model files needed: everything is built in tmp_path.
"""
import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from codraft.tokenizer import CHAR_SPECIALS, CharTokenizer, HFTokenizer, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ---------------------------------------------------------------- CharTokenizer

def test_char_round_trip_and_specials():
    tok = CharTokenizer()
    text = "Q: 12*(3+4)=? A: 84.\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert all(i >= len(CHAR_SPECIALS) for i in ids)  # text never produces a special id
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text  # specials are dropped
    assert tok.prompt_ids("1+1") == [tok.bos_id] + tok.encode("1+1")
    assert max(tok.encode(tok.alphabet)) == tok.vocab_size - 1


def test_char_unknown_maps_to_question_mark():
    tok = CharTokenizer()
    assert tok.encode("é∑") == tok.encode("??")
    assert tok.decode(tok.encode("a€b")) == "a?b"


# ---------------------------------------------------------------- HFTokenizer

def _tiny_folder(path, *, vocab_size=None, template=CHATML, system=None, add_bos=False):
    """A byte-level BPE with no merges (one id per byte) plus three special tokens."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": add_bos}))
    if template:
        (path / "chat_template.jinja").write_text(template)
    if system:
        (path / "codraft_tokenizer.json").write_text(json.dumps({"default_system_prompt": system}))
    if vocab_size is not None:
        (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return path


def test_hf_surface_and_specials(tmp_path):
    tok = HFTokenizer(_tiny_folder(tmp_path / "m"))
    assert tok.vocab_size == 3 + 256
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # no pad_token: PAD is EOS
    text = "héllo 42\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.encode("a<|im_end|>") == tok.encode("a") + [2]  # special text stays one id
    assert tok.decode(tok.encode("a<|im_end|>")) == "a"
    assert tok.decode(tok.encode("a<|im_end|>"), skip_special_tokens=False) == "a<|im_end|>"


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_prompt_jinja_equals_fallback(tmp_path, system):
    import jinja2  # noqa: F401  (comes with transformers in the dev extra; the fallback runs without it)
    template = CHATML if system is None else (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n" + system + "<|im_end|>\n' }}{% endif %}"
        + CHATML)
    folder = _tiny_folder(tmp_path / "m", template=template, system=system)
    jinja, plain = HFTokenizer(folder), HFTokenizer(folder, use_jinja=False)
    for text in ["hi", "two\nlines", ""]:
        assert jinja.chat_text(text) == plain.chat_text(text)
        assert jinja.prompt_ids(text) == plain.prompt_ids(text)
    ids = jinja.prompt_ids("hi")
    assert ids[0] == jinja.bos_id and ids[-1] == jinja.encode("\n")[0]
    assert jinja.chat_text("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_plain_prompt_without_template(tmp_path):
    tok = HFTokenizer(_tiny_folder(tmp_path / "a", template=None))
    assert not tok.is_chat and tok.prompt_ids("x") == tok.encode("x")
    tok = HFTokenizer(_tiny_folder(tmp_path / "b", template=None, add_bos=True))
    assert tok.prompt_ids("x") == [tok.bos_id] + tok.encode("x")


def test_load_tokenizer_vocab_check(tmp_path):
    assert load_tokenizer(_tiny_folder(tmp_path / "ok", vocab_size=259)).vocab_size == 259
    assert load_tokenizer(_tiny_folder(tmp_path / "padded", vocab_size=320)).vocab_size == 259
    with pytest.raises(ValueError, match=r"259 tokens .* vocab_size is 200"):
        load_tokenizer(_tiny_folder(tmp_path / "small", vocab_size=200))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
