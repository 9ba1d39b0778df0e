"""Tokenizers: a built-in character tokenizer for the tiny preset, HF `tokenizers` for real models.

Both expose the same small surface used everywhere else:
  encode(text) -> ids, decode(ids) -> text, vocab_size, and the special ids
  bos_id / eos_id / pad_id (declared in one place per tokenizer, never guessed elsewhere),
  plus prompt_ids(text): the ids a policy is conditioned on (chat template for instruct models).
"""
from __future__ import annotations

import string

# ---------------------------------------------------------------- character tokenizer

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")
CHAR_ALPHABET = string.digits + string.ascii_letters + " +-*/=().,:;?!'\"#\n_<>%$&[]{}^|~@\\`"


class CharTokenizer:
    """One id per character; specials first. Unknown characters map to '?' (never raise)."""

    def __init__(self, alphabet: str = CHAR_ALPHABET):
        self.specials = CHAR_SPECIALS
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.alphabet = alphabet
        self._to_id = {ch: i + len(CHAR_SPECIALS) for i, ch in enumerate(alphabet)}
        self._unk = self._to_id["?"]
        self.vocab_size = len(CHAR_SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        return [self._to_id.get(ch, self._unk) for ch in text]

    def decode(self, ids) -> str:
        n = len(CHAR_SPECIALS)
        return "".join(self.alphabet[i - n] for i in ids if n <= i < self.vocab_size)

    def prompt_ids(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)


# ---------------------------------------------------------------- HF `tokenizers` tokenizer

def _token_name(value) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path):
    import json
    return json.loads(path.read_text()) if path.is_file() else {}


class HFTokenizer:
    """An HF folder's tokenizer.json (via `tokenizers`, no `transformers`) behind the CharTokenizer surface.

    Special tokens come from tokenizer_config.json / special_tokens_map.json (PAD falls back to
    EOS). If the folder has a chat template (chat_template.jinja or tokenizer_config's
    ``chat_template``), prompt_ids() wraps the text as one user turn with the generation prompt:
    rendered with Jinja2 when installed, else a ChatML fallback that gives the same text for
    ChatML templates (with the default system turn from codraft_tokenizer.json, if any).
    """

    def __init__(self, model_dir, *, use_jinja: bool | None = None):
        from pathlib import Path

        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {self.model_dir} has no HF `tokenizers` tokenizer")
        self._tok = Tokenizer.from_file(str(path))
        cfg = {**_read_json(self.model_dir / "special_tokens_map.json"),
               **_read_json(self.model_dir / "tokenizer_config.json")}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id(cfg, "bos_token")
        self.eos_id = self._special_id(cfg, "eos_token")
        pad = self._special_id(cfg, "pad_token")
        self.pad_id = self.eos_id if pad is None else pad
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_id is not None
        self.chat_template = self._find_template(cfg)
        self.default_system_prompt = _read_json(self.model_dir / "codraft_tokenizer.json").get("default_system_prompt")
        self._bos_text = _token_name(cfg.get("bos_token")) or ""
        self._eos_text = _token_name(cfg.get("eos_token")) or ""
        if use_jinja is None:
            try:
                import jinja2  # noqa: F401
                use_jinja = True
            except ImportError:
                use_jinja = False
        self._jinja = self._compile(self.chat_template) if (use_jinja and self.chat_template) else None

    def _special_id(self, cfg: dict, key: str) -> int | None:
        name = _token_name(cfg.get(key))
        if name is None:
            return None
        i = self._tok.token_to_id(name)
        if i is None:
            raise ValueError(f"{self.model_dir}: {key} {name!r} is not in the tokenizer vocabulary")
        return i

    def _find_template(self, cfg: dict) -> str | None:
        file = self.model_dir / "chat_template.jinja"
        if file.is_file():
            return file.read_text()
        t = cfg.get("chat_template")
        if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        return t

    @staticmethod
    def _compile(template: str):
        import json

        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ValueError(f"chat template error: {msg}")

        # The same environment options HF uses to render chat templates, so whitespace matches.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template)

    @property
    def is_chat(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str) -> list[int]:
        # Special-token strings inside text map to their ids (as in HF); nothing is added around it.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_text(self, text: str) -> str:
        """``text`` as a single user turn followed by the assistant generation prompt."""
        return self.chat_messages([{"role": "user", "content": text}])

    @property
    def renders_tools(self) -> bool:
        """Does the chat template write tool schemas itself (``tools=`` of ``chat_messages``)?"""
        return self._jinja is not None and "tools" in self.chat_template

    def chat_messages(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Chat ``messages`` ({role, content}) followed by the assistant generation prompt; ``tools``: JSON
        schemas for a template that renders them (``renders_tools``)."""
        if self._jinja is not None:
            return self._jinja.render(messages=messages, add_generation_prompt=True, tools=tools,
                                      bos_token=self._bos_text, eos_token=self._eos_text)
        turns = [m for m in messages if m["role"] == "system"] or \
            ([{"role": "system", "content": self.default_system_prompt}] if self.default_system_prompt else [])
        turns += [m for m in messages if m["role"] != "system"]
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns) + \
            "<|im_start|>assistant\n"

    def prompt_ids(self, text: str) -> list[int]:
        if self.is_chat:
            return self.encode(self.chat_text(text))
        return ([self.bos_id] if self.add_bos else []) + self.encode(text)


def load_tokenizer(model_dir) -> HFTokenizer:
    """The tokenizer of an HF model folder, checked against its config.json's vocab_size.

    A tokenizer may have fewer ids than the embedding has rows (padded vocabularies), never more.
    """
    from pathlib import Path

    tok = HFTokenizer(model_dir)
    cfg = _read_json(Path(model_dir) / "config.json")
    n_model = cfg.get("vocab_size")
    if n_model is not None and tok.vocab_size > n_model:
        raise ValueError(f"{model_dir}: tokenizer has {tok.vocab_size} tokens but config.json vocab_size is "
                         f"{n_model}; ids >= {n_model} would index past the embedding")
    return tok
