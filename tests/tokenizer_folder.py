"""A tokenizer folder as HF writes one, byte-level with no merges: for the tokenizer, generate and context tests."""
import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer_folder(path, *, vocab_size=None, template=CHATML, system=None, add_bos=False):
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
