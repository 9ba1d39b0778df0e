"""Which target layers a draft reads, in the counting of each serving stack, and which can be served.

codraft (and SpecForge, DeepSpec, SGLang's config keys) name a tap by the 0-based decoder layer whose
*output* it is: tap l = the residual stream after layer l. vLLM and SGLang capture the stream
*entering* a layer instead, so:

    stack / key                                          id written for tap l   captured at
    codraft ``feature_layers``                           l                      output of layer l
    SpecForge / DeepSpec ``target_layer_ids``,            l                      hidden_states[l + 1] (HF)
      ``eagle_config.eagle_aux_hidden_state_layer_ids``
    SGLang (reads the nested / dflash_config ids)        l                      input of layer l + 1 (adds 1)
    vLLM top-level ``eagle_aux_hidden_state_layer_ids``   l + 1                  input of layer l + 1 (as is)
    vLLM ``dflash_config.target_layer_ids``               l                      input of layer l + 1 (adds 1)

Both capture-the-input stacks therefore cannot tap the last layer's output (there is no layer L),
and HF's ``hidden_states[L]`` is after the final norm, not the residual stream: a tap at L - 1 is
refused. The stacks concatenate the captured streams in ascending layer order (vLLM and SGLang append
them as their layer loop passes), so taps are exported ascending, with the fused ``fc`` input
permuted to match (``ascending_order``).

Not here: reading or writing checkpoints (eagle3.py, block.py).
"""
from __future__ import annotations

from typing import Sequence


def vllm_ids(taps: Sequence[int]) -> list[int]:
    """vLLM's top-level ``eagle_aux_hidden_state_layer_ids``: the layer whose *input* is each tap."""
    return [int(t) + 1 for t in taps]


def check_servable(taps: Sequence[int], num_layers: int, what: str) -> None:
    """Refuse taps the stacks cannot capture: duplicates, out of range, or the last layer's output."""
    taps = [int(t) for t in taps]
    if len(set(taps)) != len(taps) or any(not 0 <= t < num_layers for t in taps):
        raise ValueError(f"{what} taps target layers {taps}: they must be distinct layer ids in "
                         f"[0, {num_layers - 1}]")
    if num_layers - 1 in taps:
        raise ValueError(f"{what} taps target layers {taps}, including {num_layers - 1}, the last layer's "
                         f"output: vLLM and SGLang capture the stream entering layer l + 1 and the target has no "
                         f"layer {num_layers}, so no stack can feed it; retrain with taps below {num_layers - 1}")


def ascending_order(taps: Sequence[int]) -> list[int]:
    """Indices that sort ``taps`` ascending (the order the stacks concatenate captured layers in)."""
    return sorted(range(len(taps)), key=lambda i: taps[i])
