"""The refit: the trainer's current weights pushed into a vLLM engine in place, and the probe check that they
arrived.

Push (``push``), after every optimiser step:
* the policy: ``worker.reload_weights(weights_iterator=...)`` with the HF checkpoint's names
  (``codraft.models.hf_io.hf_tensors``), DTensor shards gathered (``models.layers.whole``). vLLM's loader runs as at load
  (its CPU backend repacks the linear weights, so ``model.load_weights`` on a loaded model fails).
  Its layer-wise reload replaces the embedding's parameter and puts the old tensors back into a tied LM
  head (its parameter and, on CPU, its prepacked GEMM copy), which then no longer reads the embedding
  (measured: after a changed embedding, logprobs off by 0.3–3; the probe check found it): so a tied head
  is tied again and its kernel form rebuilt after every reload;
* the drafter: ``reload.inplace.reload_weights`` on ``worker.model_runner.drafter.model`` inside
  ``set_current_vllm_config``, with the export's names and tensors (``codraft.export.eagle3.draft_tensors``,
  ``codraft.export.block.draft_tensors``); its embedding (DFlash: and LM head) is the policy's (vLLM shares
  the module), so it is not sent; a DFlash draft's learned MASK vector is (``VLLM_MASK``), and vLLM's copies
  of its K/V weights are made again (``_rebuild_context_kv``);
* then the prefix cache is dropped: its blocks hold keys and values of the old weights.

Probe check (``check``): vLLM's logprobs of a fixed probe sequence (``prompt_logprobs``: the raw
log_softmax of every token after the first) against the trainer's policy's of the same tokens. They must
agree to ``TOLERANCE[dtype]`` (max over the probe's tokens): a stale or partial refit is a
``StaleVllmWeights`` error, one line. fp32: the two compute the same products in another order (measured
≤ 1e-6 on the tiny policy); bf16: vLLM rounds weights and activations to bf16, the trainer does not
(docs/vllm.md has the measured figures and what the looser bound can and cannot see).
"""
from __future__ import annotations

import torch

from codraft.errors import CodraftError
from codraft.export import block, eagle3
from codraft.models.hf_io import hf_tensors
from codraft.models.layers import whole
from codraft.vllm.serving import Served, learned_mask

# max |Δ logprob| over the probe. Measured on the tiny policy (4 layers, hidden 128; AMD EPYC, 2026-12-06):
# fp32 ≤ 1e-6 after refits; bf16 0.004-0.005, and 0.058 when a whole update of size 1e-3 was not pushed.
# Deeper models round more in bf16: unmeasured, the bound may need raising there (docs/vllm.md).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}
VLLM_MASK = "mask_embedding"  # DFlashQwen3ForCausalLM.load_weights: model.mask_embedding, read from MASK_FILE at load


class StaleVllmWeights(CodraftError, RuntimeError):
    """vLLM's logprobs of the probe are not the trainer's policy's: the last refit did not (fully) arrive."""


def policy_tensors(policy) -> dict[str, torch.Tensor]:
    """The policy's tensors under their HF names, gathered when sharded (collective: every rank calls)."""
    return hf_tensors({k: whole(v).detach() for k, v in policy.state_dict().items()}, policy.config)


def drafter_tensors(draft) -> dict[str, torch.Tensor]:
    """The draft's tensors as its vLLM export holds them (gathered when sharded); a DFlash draft's learned MASK
    vector (the export's mask_embedding.pt) under vLLM's name for it."""
    state = {k: whole(v).detach() for k, v in draft.state_dict().items()}
    if block.ARCHITECTURES["dflash"] not in draft.architectures:  # (EAGLE-3: the config allows no other)
        return eagle3.draft_tensors(draft, torch.float32, "vllm", state=state)
    tensors = block.draft_tensors(draft, torch.float32, state=state)
    if learned_mask(draft):
        tensors[VLLM_MASK] = state["mask_embedding"].float()
    return tensors


@torch.no_grad()
def push(served: Served, policy, draft=None) -> None:
    """Reload ``policy`` (and ``draft``, when given and the engine drafts) into ``served`` in place."""
    worker = served.worker
    worker.reload_weights(weights_iterator=iter(policy_tensors(policy).items()))
    _retie_head(worker.model_runner.get_model())
    if draft is not None and served.gamma:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        drafter = worker.model_runner.drafter.model
        if hasattr(drafter, "_read_mask_embedding"):  # DFlash: the MASK vector comes with the tensors
            drafter._read_mask_embedding = _no_mask_file
        tensors = drafter_tensors(draft)
        with set_current_vllm_config(worker.vllm_config):
            reload_weights(worker.vllm_config, drafter, weights_iterator=iter(tensors.items()), weights_path=None,
                           is_checkpoint_format=True)
        _rebuild_context_kv(drafter, tensors)
    served.llm.reset_prefix_cache()


def _no_mask_file() -> None:
    """vLLM's DFlash drafter reads its learned MASK vector from the folder's mask_embedding.pt at every load, and
    it would win over the one sent (``VLLM_MASK``): that folder is removed after the build (else it would hold
    the build's vector, and with it gone vLLM asks the Hugging Face hub for the path). Nothing is read."""


def _rebuild_context_kv(drafter, tensors: dict[str, torch.Tensor]) -> None:
    """DFlash: vLLM projects the context's keys and values with copies of every layer's K/V weights, K-norm and
    hidden norm made at the end of its ``load_weights`` (``_build_fused_kv_buffers``). In an in-place reload that
    runs when the layers are already processed, and on CPU a processed linear keeps its weight only in its
    kernel's packed copy (the parameter is empty): the copies come out empty (measured: "size mismatch, got
    input (10), mat (10x128), vec (0)" at the next decode). So they are made again now, by vLLM's function, each
    layer's fused q/k/v weight (vLLM's ``qkv_proj``: q, k, v rows stacked) lent back from the sent tensors."""
    inner = getattr(drafter, "model", None)
    if not hasattr(inner, "_build_fused_kv_buffers"):
        return
    lent = []
    for i, layer in enumerate(inner.layers):
        proj = layer.self_attn.qkv_proj
        lent.append(proj.weight)
        qkv = torch.cat([tensors[f"layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv"])
        proj.weight = torch.nn.Parameter(qkv.to(proj.weight.dtype), requires_grad=False)
    try:
        inner._build_fused_kv_buffers()
    finally:
        for layer, weight in zip(inner.layers, lent):
            layer.self_attn.qkv_proj.weight = weight


def _retie_head(model) -> None:
    """A tied LM head reads the embedding's current parameter again (the reload replaced it), and its kernel
    form is made again from it (on CPU the head's GEMM reads a prepacked copy, ``cpu_linear``)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if getattr(model.config, "tie_word_embeddings", False) and embed is not None and head is not None:
        head.tie_weights(embed)
        head.quant_method.process_weights_after_loading(head)


def engine_logprobs(served: Served, probe: list[int]) -> torch.Tensor:
    """vLLM's logprob of each probe token after the first (raw log_softmax)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = served.llm.generate([TokensPrompt(prompt_token_ids=list(probe))], params, use_tqdm=False)[0]
    return torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], probe[1:])],
                        dtype=torch.float64)


@torch.no_grad()
def trainer_logprobs(policy, probe: list[int]) -> torch.Tensor:
    """The trainer's policy's logprob of each probe token after the first (fp32 log_softmax)."""
    device = next(policy.parameters()).device
    ids = torch.tensor([probe], device=device)
    logits = policy(ids)[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].double().cpu()


def check(served: Served, policy, probe: list[int], when: str) -> float:
    """Raise ``StaleVllmWeights`` unless vLLM and the trainer agree on the probe; returns the largest difference."""
    gap = float((engine_logprobs(served, probe) - trainer_logprobs(policy, probe)).abs().max())
    tol = TOLERANCE[served.dtype]
    if not gap <= tol:  # (NaN too)
        raise StaleVllmWeights(f"{when}: stale or partial refit: vLLM's logprobs of the probe sequence differ from "
                               f"the trainer's policy by up to {gap:.3g} (more than {tol:g} at {served.dtype}): the "
                               f"engine does not hold the weights of the last update")
    return gap
