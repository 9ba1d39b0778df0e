"""ModelConfig: the decoder's hyper-parameters, named exactly as in HF `config.json`.

Covers the Llama and Qwen3 families (Qwen3 adds q/k RMSNorm) and their mixture-of-experts forms,
Qwen3-MoE and Qwen2-MoE (a shared expert; without attention biases), and the dense families users start
from: Qwen2 (q/k/v biases), Mistral and Phi-3 (a sliding window on every layer; Phi-3's fused
projections are split on load, ``hf_io``), Gemma 2 and Gemma 3 text (sliding-window layers alternating
with global ones, soft-capping, (1 + w) norms around both sub-blocks, GeGLU, scaled embeddings; Gemma 3's
q/k norms and local RoPE base). What a family's config may hold that is not modelled (long-context RoPE
variants, partial rotary, bidirectional attention, ...) is refused in one line. Unknown HF keys are
ignored on load; fields we do not model are not written back.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                       "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
ARCHITECTURES = (*DENSE_ARCHITECTURES, "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
_ARCH_TO_TYPE = {a: t for t, a in _TYPE_TO_ARCH.items()}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_WINDOWED = ("Qwen2ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", *GEMMA)  # architectures with a window
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
             "mlp_only_layers", "shared_expert_intermediate_size", "router_aux_loss_coef")


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # mixture of experts (Qwen3-MoE; Qwen2-MoE adds a shared expert): layer i is sparse when num_experts > 0,
    # i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (codraft.models.moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001  # HF's; the trainer's is grpo.router_aux_coef
    qkv_bias: bool = False  # Qwen2-MoE's q/k/v biases: not modelled, refused
    # MLP activation: hidden_act (Gemma's key: hidden_activation, which wins): silu (SwiGLU) or GeGLU's tanh gelu
    hidden_act: str = "silu"
    hidden_activation: str | None = None
    # sliding-window attention: layer i sees the last `sliding_window` positions (itself included) when
    # layer_types[i] == "sliding_attention"; resolved per architecture in __post_init__ (`window`)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    use_sliding_window: bool = False  # Qwen2's switch, with max_window_layers: layers below it stay global
    max_window_layers: int = 28  # (HF Qwen2Config's default)
    sliding_window_pattern: int | None = None  # Gemma 3's older form of layer_types: every n-th layer global
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5; tanh soft-capping of scores and final logits
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None  # Gemma 3: the sliding layers' RoPE base
    # refused when set: not modelled
    attention_bias: bool = False
    use_bidirectional_attention: bool | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        arch = self.architectures[0] if self.architectures else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if arch in MOE_ARCHITECTURES:
            self._check_experts(arch)
        self._check_family(arch)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    def _check_experts(self, arch: str):
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{arch}: need num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, got "
                             f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"{arch}: need moe_intermediate_size >= 1 and decoder_sparse_step >= 1, got "
                             f"{self.moe_intermediate_size}, {self.decoder_sparse_step}")
        if self.qkv_bias:
            raise ValueError(f"{arch} with qkv_bias=true: attention biases are not modelled (only qkv_bias=false)")
        if arch == "Qwen3MoeForCausalLM" and self.shared_expert_intermediate_size:
            raise ValueError("Qwen3MoeForCausalLM has no shared expert: shared_expert_intermediate_size must be 0 "
                             "(Qwen2MoeForCausalLM has one)")

    def _check_family(self, arch: str):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{arch}: activation {self.activation!r} is not modelled "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        if self.attention_bias or self.use_bidirectional_attention:
            raise ValueError(f"{arch} with attention_bias or use_bidirectional_attention: not modelled")
        if self.partial_rotary_factor != 1.0:
            raise ValueError(f"{arch} with partial_rotary_factor={self.partial_rotary_factor}: only full rotary "
                             "embeddings (1.0) are modelled")
        if arch not in _WINDOWED or arch == "Qwen2ForCausalLM" and not self.use_sliding_window:
            self.sliding_window = None  # (HF's Qwen2 drops it too; Llama and Qwen3 keep their plain layers)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{arch}: sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_window is None:
            self.layer_types = None
        elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # HF windows every layer of these
            self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        elif self.layer_types is None:
            if arch == "Qwen2ForCausalLM":
                self.layer_types = ["sliding_attention" if i >= self.max_window_layers else "full_attention"
                                    for i in range(self.num_hidden_layers)]
            else:  # Gemma 2: every 2nd layer global; Gemma 3: every sliding_window_pattern-th (6)
                n = 2 if arch == "Gemma2ForCausalLM" else self.sliding_window_pattern or 6
                self.layer_types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                                    for i in range(self.num_hidden_layers)]
        if self.layer_types is not None:
            # a draft built from this config with fewer layers (a model draft) keeps the first layers' types
            self.layer_types = list(self.layer_types[:self.num_hidden_layers])
            bad = set(self.layer_types) - {"sliding_attention", "full_attention"}
            if len(self.layer_types) != self.num_hidden_layers or bad:
                raise ValueError(f"{arch}: layer_types must name sliding_attention or full_attention for each of "
                                 f"the {self.num_hidden_layers} layers, got {self.layer_types}")
        if arch in GEMMA and self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = 256  # (HF's default)
        if arch not in GEMMA and (self.attn_logit_softcapping or self.final_logit_softcapping
                                  or self.query_pre_attn_scalar or self.rope_local_base_freq):
            raise ValueError(f"{arch}: soft-capping, query_pre_attn_scalar and rope_local_base_freq are Gemma's")
        if arch == "Gemma3ForCausalLM" and self.rope_local_base_freq is None:
            self.rope_local_base_freq = 10000.0  # (HF's default)

    @property
    def activation(self) -> str:
        return self.hidden_activation or self.hidden_act

    @property
    def gemma(self) -> bool:
        """(1 + w) RMSNorms, norms before and after both sub-blocks, embeddings scaled by sqrt(hidden)."""
        return self.architectures[0] in GEMMA

    @property
    def qkv_biased(self) -> bool:
        return self.architectures[0] == "Qwen2ForCausalLM"

    @property
    def fused_projections(self) -> bool:
        """Phi-3's checkpoints hold qkv_proj and gate_up_proj, split on load and fused on save (``hf_io``)."""
        return self.architectures[0] == "Phi3ForCausalLM"

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (positions seen, its own included), or None: global attention."""
        if self.layer_types is None or self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_softcap(self) -> float | None:
        """Gemma 2's tanh cap on attention scores (Gemma 3's config may name one; its attention, as HF's, has none)."""
        return self.attn_logit_softcapping if self.architectures[0] == "Gemma2ForCausalLM" else None

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' scale where it is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar)."""
        q = self.query_pre_attn_scalar
        return None if q is None or q == self.head_dim else q ** -0.5

    @property
    def moe(self) -> bool:
        return self.architectures[0] in MOE_ARCHITECTURES

    def sparse_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` is a mixture of experts (HF's rule)."""
        return self.moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def qk_norm(self) -> bool:
        return self.architectures[0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")

    @property
    def model_type(self) -> str:
        return _ARCH_TO_TYPE[self.architectures[0]]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        rope = dict(d.pop("rope_parameters", None) or {})
        if "full_attention" in rope or "sliding_attention" in rope:  # Gemma 3: one set per layer type
            local = rope.get("sliding_attention") or {}
            if "rope_theta" in local:
                d.setdefault("rope_local_base_freq", local["rope_theta"])
            rope = dict(rope.get("full_attention") or {})
        if "partial_rotary_factor" in rope:
            d.setdefault("partial_rotary_factor", rope.pop("partial_rotary_factor"))
        if "rope_theta" in rope:
            d.setdefault("rope_theta", rope.pop("rope_theta"))
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            d.setdefault("rope_scaling", rope)
        if "num_local_experts" in d:  # transformers >= 5 writes num_experts under this name
            d.setdefault("num_experts", d.pop("num_local_experts"))
        if not d.get("architectures") and d.get("model_type") in _TYPE_TO_ARCH:
            d["architectures"] = [_TYPE_TO_ARCH[d["model_type"]]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        """HF-style dict, readable by transformers 4.x (rope_scaling) and 5.x (rope_parameters)."""
        d = dataclasses.asdict(self)
        if not self.moe:  # a dense model's config.json as before
            for k in (*_MOE_KEYS, "qkv_bias"):
                d.pop(k)
        elif self.model_type != "qwen2_moe":
            d.pop("qkv_bias")
        arch = self.architectures[0]
        for k in ("hidden_activation", "attention_bias", "use_bidirectional_attention", "partial_rotary_factor",
                  "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                  "rope_local_base_freq", "sliding_window_pattern", "use_sliding_window", "max_window_layers",
                  "sliding_window", "layer_types"):
            d.pop(k)
        if arch in _WINDOWED:  # the window as HF's config class of the family reads it back
            d["sliding_window"] = self.sliding_window
            if arch == "Qwen2ForCausalLM":
                d.update(use_sliding_window=self.sliding_window is not None, max_window_layers=self.max_window_layers)
            if arch in ("Qwen2ForCausalLM", *GEMMA) and self.layer_types is not None:
                d["layer_types"] = self.layer_types
        d["model_type"] = self.model_type
        d["hidden_act"] = self.activation
        d["rope_parameters"] = {"rope_theta": self.rope_theta,
                                **(self.rope_scaling or {"rope_type": "default"})}
        if self.gemma:
            d.update(hidden_activation=self.activation, query_pre_attn_scalar=self.query_pre_attn_scalar,
                     attn_logit_softcapping=self.attn_logit_softcapping,
                     final_logit_softcapping=self.final_logit_softcapping)
        if arch == "Gemma3ForCausalLM":  # transformers 5 reads one RoPE per layer type, 4.x the two bases
            d["rope_local_base_freq"] = self.rope_local_base_freq
            local = {"rope_type": "default", "rope_theta": self.rope_local_base_freq}
            d["rope_parameters"] = {"full_attention": d["rope_parameters"], "sliding_attention": local}
        if self.rope_scaling is None:
            d.pop("rope_scaling")
        return d
