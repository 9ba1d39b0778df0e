"""DFlash and DSpark export: the layouts SpecForge / DeepSpec train and vLLM / SGLang serve.

Backbone tensors already carry the public names (Qwen3-style layers with q_norm / k_norm,
``fc``, ``hidden_norm``, ``norm``); DSpark's heads are renamed (``PUBLIC_NAMES``). The config is
SpecForge's (``architectures`` DFlashDraftModel / DSparkDraftModel, ``model_type`` qwen3,
``block_size``, ``num_target_layers``, all-``full_attention`` ``layer_types``, and
``dflash_config.{mask_token_id, target_layer_ids}``); DSpark adds its head keys both nested in
``dflash_config`` (SpecForge) and top level (DeepSpec's Qwen3DSparkModel, read by vLLM and SGLang),
with ``sample_from_anchor: true`` (slot k predicts anchor + k + 1, as codraft trains it).

The MASK slots. Every stack feeds them as the token id ``mask_token_id`` through an embedding.
A draft trained with ``mask_token_id`` (a target row) exports as is. codraft's default is a
learned MASK vector instead; it needs a token id the policy never emits (``--mask-token-id``) and
is written where each stack can take it:

    DFlash  vLLM: mask_embedding.pt {mask_token_id, embedding} replaces that row   exact
            SpecForge, SGLang: use the target's own row at mask_token_id        not exact (no slot)
    DSpark  vLLM, DeepSpec: the draft's own embed_tokens (shipped, row patched)  exact
            SpecForge, SGLang: the target's row                                   not exact (no slot)

DSpark folders carry ``embed_tokens.weight`` and ``lm_head.weight`` (copies of the target's, as
DeepSpec's model owns them); DFlash folders carry neither (the stacks share the target's).

DSpark's architecture name and Markov head decide which stacks load the folder (``--stack``,
``DSPARK_ARCHITECTURE``): Qwen3DSparkModel loads in vLLM and SGLang, DSparkDraftModel in SpecForge;
a gated head not in vLLM. The written ``codraft_export`` record lists them.

Not here: tap conventions (taps.py), writing the folder (write.py), reading it back (reader.py).
"""
from __future__ import annotations

import torch

from codraft.drafts.block_backbone import BlockDraftBase
from codraft.drafts.dspark import MARKOV_KINDS
from codraft.export.layout import STACK_NAMES, STACKS, Layout, cast, dtype_name
from codraft.export.taps import ascending_order, check_servable

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
# DSpark's architecture name per --stack, as read in the loaders' sources (2026-12-05): vLLM's Qwen3 DSpark
# class is Qwen3DSparkModel, and it takes the legacy DSparkDraftModel only where its config override renames a
# qwen3-typed one to it (older releases route DSparkDraftModel to the DeepSeek-V4 weights-in-target draft);
# SGLang registers only Qwen3DSparkModel; SpecForge trains and saves DSparkDraftModel (renamed before serving).
# Not checked: whether SpecForge reads Qwen3DSparkModel. So the serving stacks get Qwen3DSparkModel and
# SpecForge (continued training) its own name.
SERVING_DSPARK = "Qwen3DSparkModel"
DSPARK_ARCHITECTURE = {"all": SERVING_DSPARK, "vllm": SERVING_DSPARK, "sglang": SERVING_DSPARK,
                       "specforge": "DSparkDraftModel"}
_TAKES_NAME = {"DSparkDraftModel": ("specforge",), SERVING_DSPARK: ("vllm", "sglang")}
# the Markov heads each DSpark loader builds (docs/serving.md: vLLM only the vanilla one; SGLang's dspark_config
# and SpecForge both)
_TAKES_HEAD = {"vanilla": ("vllm", "sglang", "specforge"), "gated": ("sglang", "specforge")}
# codraft parameter name prefix -> public one (DSpark heads; the backbone's names already match)
PUBLIC_NAMES = {"markov_head.w1.": "markov_head.markov_w1.", "markov_head.w2.": "markov_head.markov_w2.",
                "markov_head.gate.": "markov_head.gate_proj.", "confidence_head.": "confidence_head.proj."}
MASK_FILE = "mask_embedding.pt"  # vLLM's name for a separately trained MASK vector


def public_name(name: str) -> str:
    for ours, theirs in PUBLIC_NAMES.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def codraft_name(name: str) -> str:
    for ours, theirs in PUBLIC_NAMES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def layout(draft: BlockDraftBase, kind: str, target, dtype: torch.dtype, *,
           mask_token_id: int | None = None, stack: str = "all") -> Layout:
    """The exported folder's config, tensors and extra files for a DFlash / DSpark ``draft``; ``stack``
    (all, vllm, sglang, specforge) picks DSpark's architecture name."""
    c = draft.config
    if c.draft_vocab_size:
        raise ValueError(f"this {kind} draft predicts {c.draft_vocab_size} of the target's {c.vocab_size} tokens "
                         "(draft_vocab_size): the DFlash/DSpark formats vLLM, SGLang and SpecForge read have no "
                         "draft vocabulary; export a draft trained with draft_vocab_size=0")
    taps = [int(t) for t in c.target_layer_ids]
    check_servable(taps, target.config.num_hidden_layers, f"{kind} draft")
    mask_id, learned = _mask_token(c, mask_token_id, target.config.vocab_size, kind)
    order = ascending_order(taps)
    tensors = draft_tensors(draft, dtype)
    extra, notes = {}, []
    if learned:
        vector = cast(draft.mask_embedding, dtype)
        extra[MASK_FILE] = {"mask_token_id": mask_id, "embedding": vector}
        exact = "vLLM and DeepSpec read it (row of the shipped embed_tokens)" if kind == "dspark" else \
            f"vLLM reads it ({MASK_FILE})"
        notes.append(f"MASK is a learned vector, fed as token {mask_id}: {exact}; SpecForge and SGLang embed MASK "
                     f"with the target's own row {mask_id}, a different vector (still lossless, lower acceptance). "
                     "Train with mask_token_id set to serve exactly everywhere")
    arch, stacks, record = ARCHITECTURES[kind], list(STACKS), {}
    if kind == "dspark":
        embed = cast(target.embed_tokens.weight, dtype)
        if learned:
            embed[mask_id] = vector
        tensors["embed_tokens.weight"] = embed
        tensors["lm_head.weight"] = cast(target.head_weight, dtype)
        arch = DSPARK_ARCHITECTURE[stack]
        # per Markov head, the stacks that load a folder of this name with it
        heads = {h: [s for s in STACKS if s in _TAKES_NAME[arch] and s in _TAKES_HEAD[h]] for h in MARKOV_KINDS}
        stacks, record = heads[draft.markov_kind], {"markov_head": {"type": draft.markov_kind, **heads}}
        if stack != "all" and stack not in stacks:  # vLLM asked for with a gated head
            raise ValueError(f"--stack {stack}: {STACK_NAMES[stack]} builds only the plain 'vanilla' DSpark head, and "
                             f"this draft's is {draft.markov_kind!r}; SGLang loads it (--stack sglang or all), "
                             "SpecForge with --stack specforge; or train the draft with the vanilla head")
        notes += _dspark_notes(arch, draft.markov_kind, stacks)
    ascending = [taps[i] for i in order]
    if ascending != taps:
        notes.append(f"taps {taps} written ascending as {ascending} (fc input blocks permuted to match)")
    config = _config(draft, kind, arch, ascending, mask_id, learned, dtype)
    gamma = c.block_size - 1 if kind == "dflash" else c.block_size
    return Layout(config, tensors, extra, taps=ascending, gamma=gamma, mask_token_id=mask_id, notes=notes,
                  stacks=stacks, record=record)


def draft_tensors(draft: BlockDraftBase, dtype: torch.dtype,
                  state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The draft's own tensors as the folder's ``model.safetensors`` holds them (public names, fc's input blocks
    in ascending tap order), in ``dtype``; not the learned MASK vector (``MASK_FILE``, apart) nor DSpark's copies
    of the target's embedding and head. ``state``: the draft's tensors (default its state dict; a sharded
    draft's gathered). Also what an engine serving the folder reloads in place (codraft.vllm.refit)."""
    state = draft.state_dict() if state is None else state
    taps = [int(t) for t in draft.config.target_layer_ids]
    order = ascending_order(taps)
    state = {k: v for k, v in state.items() if k != "mask_embedding"}
    fc = state["fc.weight"]
    fc = fc.view(fc.shape[0], len(taps), -1)[:, order].reshape(fc.shape)  # input blocks in layer order
    return {public_name(k): cast(fc if k == "fc.weight" else v, dtype) for k, v in state.items()}


def _dspark_notes(arch: str, markov: str, stacks: list[str]) -> list[str]:
    """What the DSpark name and head mean for each stack (the tables above ``layout``); ``stacks``: those
    that load this folder."""
    if arch == SERVING_DSPARK:
        name = (f"architecture {arch}, the name vLLM and SGLang register; SpecForge reads DSparkDraftModel: export "
                "again with --stack specforge to continue training there")
        elsewhere = "SpecForge takes gated heads too, under DSparkDraftModel (--stack specforge)"
    else:
        name = (f"architecture {arch}, the name SpecForge reads; vLLM and SGLang serve {SERVING_DSPARK}: export "
                "again with --stack all to serve")
        elsewhere = f"SGLang takes gated heads too, under {SERVING_DSPARK} (--stack sglang)"
    if markov == "vanilla":
        head = "Markov head 'vanilla', the plain head, which vLLM, SGLang and SpecForge all build (a gated head: " \
               "SGLang and SpecForge only)"
    else:
        taker = " and ".join(STACK_NAMES[s] for s in stacks)
        head = f"Markov head {markov!r}: {taker} takes it as written; {elsewhere}; vLLM builds only the plain " \
               "'vanilla' head"
    return [name, head]


def _mask_token(c, option: int | None, vocab: int, kind: str) -> tuple[int, bool]:
    """(the MASK token id to write, whether the MASK input is a learned vector)."""
    if c.mask_token_id is not None:
        if option is not None and option != c.mask_token_id:
            raise ValueError(f"the {kind} draft was trained with mask_token_id={c.mask_token_id} (that target row is "
                             f"its MASK input); --mask-token-id {option} would feed it another vector")
        return int(c.mask_token_id), False
    if option is None:
        raise ValueError(f"this {kind} draft embeds MASK slots with a learned vector, but vLLM, SGLang and "
                         "SpecForge feed MASK as a token id: pass --mask-token-id ID, a token the policy never "
                         "emits (an embedding row past the tokenizer's last id, or an unused special such as "
                         "<pad>, id 0 in the tiny preset); the export writes the learned vector for that id")
    if not 0 <= option < vocab:
        raise ValueError(f"--mask-token-id {option} is outside the target vocabulary [0, {vocab})")
    return int(option), True


def _config(draft: BlockDraftBase, kind: str, arch: str, taps: list[int], mask_id: int, learned: bool,
            dtype: torch.dtype) -> dict:
    c, k = draft.config, draft.config.num_hidden_layers
    name = dtype_name(dtype)
    config = {
        "architectures": [arch], "model_type": "qwen3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": k, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * k, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": k, "num_target_layers": c.num_target_layers,
        "target_hidden_size": c.target_hidden_size, "block_size": c.block_size,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": taps},
        "torch_dtype": name, "dtype": name,
        # training settings: no stack reads them; codraft's reader does (a resumed fine-tune keeps them)
        "codraft": {"kind": kind, "learned_mask_embedding": learned, "loss_decay": c.loss_decay,
                    "num_anchors": c.num_anchors, "loss_chunk_blocks": c.loss_chunk_blocks,
                    "default_gamma": draft.default_gamma},
    }
    if kind == "dspark":
        heads = {"markov_rank": draft.markov_rank, "markov_head_type": draft.markov_kind,
                 "enable_confidence_head": True, "confidence_head_with_markov": True}
        gqa = c.num_key_value_heads < c.num_attention_heads
        config["dflash_config"].update(heads, projector_type="dspark", attention_mode="gqa" if gqa else "mha",
                                       confidence_head_alpha=draft.conf_weight)
        # DeepSpec's Qwen3DSparkModel asserts these top-level keys (num_anchors included)
        config.update(heads, mask_token_id=mask_id, target_layer_ids=taps, num_anchors=c.num_anchors,
                      sample_from_anchor=True)
        config["codraft"].update(ce_weight=draft.ce_weight, tv_weight=draft.tv_weight, conf_weight=draft.conf_weight)
    return config
