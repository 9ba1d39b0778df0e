"""The policy model: config, decoder, KV cache and HF-format I/O."""
from codraft.models.config import ModelConfig, ARCHITECTURES
from codraft.models.kv_cache import KVCache
from codraft.models.transformer import Transformer
from codraft.models.hf_io import load_pretrained, save_pretrained

__all__ = ["ModelConfig", "ARCHITECTURES", "KVCache", "Transformer", "load_pretrained", "save_pretrained"]
