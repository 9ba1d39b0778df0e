"""`codraft bench moe`: what verifying γ + 1 tokens costs a mixture-of-experts target against a dense
target of the same active size (the paper's limits section: a MoE target's verify forward activates
more experts than one plain token, so a long acceptance length buys less).

Two random targets of the same attention and the same parameters *per token*: a dense Qwen3 decoder
(SwiGLU of k · ``--moe-size``) and a Qwen3-MoE one (``--experts`` experts of ``--moe-size``, top-k),
fp32, the CPU fast path enabled (``kernels.enable``: the MoE layers keep the C attention and run their
experts' products through the measured product dispatch, one product per active expert). For each,
``--batch`` rows hold ``--context`` cached tokens; one forward of t = 1 token per row (a plain decode
step) and of t = γ + 1 (a verify forward) is timed (median of ``--repeats`` after 3 untimed calls),
the cache rolled back after each. ``verify_over_plain`` = time(γ + 1) / time(1); ``experts_active``:
the distinct experts the forward's tokens route to, mean over the MoE layers. Every row carries the CPU
model and date.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

from codraft import kernels
from codraft.bench import format_table, machine_info
from codraft.models import KVCache, ModelConfig, Transformer
from codraft.models.moe import SparseMoE

COLUMNS = ("target", "gamma", "tokens", "ms_plain", "ms_verify", "verify_over_plain", "experts_active")


def _targets(hidden: int, layers: int, experts: int, top_k: int, moe_size: int) -> dict[str, Transformer]:
    base = dict(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    dense = Transformer(ModelConfig(**base, intermediate_size=top_k * moe_size, architectures=["Qwen3ForCausalLM"]))
    moe = Transformer(ModelConfig(**base, intermediate_size=top_k * moe_size, architectures=["Qwen3MoeForCausalLM"],
                                  num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_size))
    return {"dense": kernels.enable(dense.eval()), f"moe {experts}x top-{top_k}": kernels.enable(moe.eval())}


def _time(model: Transformer, cache: KVCache, ids: torch.Tensor, repeats: int) -> float:
    start = cache.lengths.clone()
    out = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        model(ids, cache=cache, logit_index=torch.zeros_like(start))
        if i >= 3:
            out.append(time.perf_counter() - t0)
        cache.set_lengths(start, span=int(start.max()))
    return statistics.median(out) * 1e3


def _experts_active(model: Transformer, cache: KVCache, ids: torch.Tensor) -> float | None:
    seen = []

    def hook(module, args):
        _, _, experts = module.route(args[0].reshape(-1, args[0].shape[-1]))
        seen.append(experts.unique().numel())
    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, SparseMoE)]
    start = cache.lengths.clone()
    model(ids, cache=cache, logit_index=torch.zeros_like(start))
    cache.set_lengths(start, span=int(start.max()))
    for h in handles:
        h.remove()
    return sum(seen) / len(seen) if seen else None


@torch.inference_mode()
def run(*, hidden: int = 512, layers: int = 8, experts: int = 16, top_k: int = 2, moe_size: int = 512,
        gammas=(1, 3, 7), batch: int = 1, context: int = 128, repeats: int = 20, threads: int = 2,
        json_path: str | os.PathLike | None = None, log=print) -> dict:
    torch.set_num_threads(threads)
    result = {"bench": "moe", "machine": machine_info(), "settings": dict(
        hidden=hidden, layers=layers, experts=experts, top_k=top_k, moe_size=moe_size, gammas=list(gammas),
        batch=batch, context=context, repeats=repeats, threads=threads), "rows": []}
    g = torch.Generator().manual_seed(0)
    for name, model in _targets(hidden, layers, experts, top_k, moe_size).items():
        cache = KVCache.for_model(model, batch, context + max(gammas) + 2)
        model(torch.randint(0, 4096, (batch, context), generator=g), cache=cache,
              logit_index=torch.zeros(batch, dtype=torch.long))
        one = torch.randint(0, 4096, (batch, 1), generator=g)
        ms_plain = _time(model, cache, one, repeats)
        for gamma in gammas:
            ids = torch.randint(0, 4096, (batch, gamma + 1), generator=g)
            ms = _time(model, cache, ids, repeats)
            row = {"target": name, "gamma": gamma, "tokens": batch * (gamma + 1), "ms_plain": ms_plain,
                   "ms_verify": ms, "verify_over_plain": ms / ms_plain,
                   "experts_active": _experts_active(model, cache, ids)}
            result["rows"].append(row)
            log(f"  {name}, γ={gamma}: {ms_plain:.2f} ms plain, {ms:.2f} ms verify")
    log(f"\n{result['machine']['processor']}, {result['machine']['date']}")
    log(format_table([[r[c] for c in COLUMNS] for r in result["rows"]], list(COLUMNS)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        log(f"wrote {json_path}")
    return result
