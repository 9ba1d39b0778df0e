"""Tokenizers: CharTokenizer round trip and specials; HFTokenizer on a tiny byte-level tokenizer
(specials, chat template via Jinja vs the ChatML fallback, plain prompts) and load_tokenizer's
vocab-size check against config.json. No model files needed: everything is built in tmp_path.
"""
import pytest

from codraft.tokenizer import CHAR_SPECIALS, CharTokenizer, HFTokenizer, load_tokenizer
from tokenizer_folder import CHATML, tiny_tokenizer_folder


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


def test_hf_surface_and_specials(tmp_path):
    tok = HFTokenizer(tiny_tokenizer_folder(tmp_path / "m"))
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
    folder = tiny_tokenizer_folder(tmp_path / "m", template=template, system=system)
    jinja, plain = HFTokenizer(folder), HFTokenizer(folder, use_jinja=False)
    for text in ["hi", "two\nlines", ""]:
        assert jinja.chat_text(text) == plain.chat_text(text)
        assert jinja.prompt_ids(text) == plain.prompt_ids(text)
    ids = jinja.prompt_ids("hi")
    assert ids[0] == jinja.bos_id and ids[-1] == jinja.encode("\n")[0]
    assert jinja.chat_text("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_plain_prompt_without_template(tmp_path):
    tok = HFTokenizer(tiny_tokenizer_folder(tmp_path / "a", template=None))
    assert not tok.is_chat and tok.prompt_ids("x") == tok.encode("x")
    tok = HFTokenizer(tiny_tokenizer_folder(tmp_path / "b", template=None, add_bos=True))
    assert tok.prompt_ids("x") == [tok.bos_id] + tok.encode("x")


def test_load_tokenizer_vocab_check(tmp_path):
    assert load_tokenizer(tiny_tokenizer_folder(tmp_path / "ok", vocab_size=259)).vocab_size == 259
    assert load_tokenizer(tiny_tokenizer_folder(tmp_path / "padded", vocab_size=320)).vocab_size == 259
    with pytest.raises(ValueError, match=r"259 tokens .* vocab_size is 200"):
        load_tokenizer(tiny_tokenizer_folder(tmp_path / "small", vocab_size=200))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
