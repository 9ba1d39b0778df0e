"""``VllmEngine``: codraft's ``Engine.generate`` over one vLLM engine, so the trainer decodes through either.

What the trainer reads comes back as codraft's engine gives it: ``GenerationResult`` per prompt (the new
tokens up to and including EOS, each token's logprob in codraft's convention, "eos" or "length") and
``stats``, a ``SpecStats`` of the call. Differences, all from vLLM:

* seeds: one per request, derived from the call's ``seed`` (request i: seed + i·φ mod 2^63), so a seed
  repeats a rollout on one machine and build; vLLM's sampler is not codraft's, so the same seed samples
  other tokens than codraft's engine;
* top-p: vLLM keeps the smallest set of tokens whose mass reaches top_p, as codraft does, but may break ties
  at the boundary otherwise;
* statistics: from vLLM's per-request acceptance histograms (steps that accepted j drafts). A row-round is
  one verify step of one request; vLLM does not report batched rounds, so ``rounds`` counts row-rounds, and
  every step is taken to have drafted γ tokens (vLLM drafts fewer only at the context's end);
* ``progress`` is called once, when every row has finished (vLLM's ``generate`` returns at the end).
"""
from __future__ import annotations

import time

import torch

from codraft.rollout.engine import GenerationResult, token_ids, validate_prompts
from codraft.rollout.stats import SpecStats
from codraft.vllm.serving import Served

_PHI = 0x9E3779B97F4A7C15  # request i's seed: the call's + i·φ (distinct, well spread)


class VllmEngine:
    """``VllmEngine(served, sync=None)``: generate with ``served``; ``sync`` (if given) is called before each
    call, to refit an engine whose weights may be behind the trainer's (the plain engine, used rarely)."""

    acceptance = None  # (rollout.draft_length=auto is codraft's engine's only)

    def __init__(self, served: Served, sync=None):
        self.served, self.sync = served, sync
        self.gamma = served.gamma
        self.stats = SpecStats(gamma=self.gamma)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 eos_id: int | list[int] | None = None, progress=None) -> list[GenerationResult]:
        """One result per prompt, as ``codraft.rollout.Engine.generate`` (temperature 0 = greedy; eos_id None: the
        policy's; seed None: drawn from torch's global RNG)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # codraft's engine's refusals, before vLLM's own (which are less plain)
        validate_prompts(prompts, max_new_tokens, self.served.max_len, self.served.vocab_size)
        if self.sync is not None:
            self.sync(self.served)
        base = int(torch.randint(2**62, (1,))) if seed is None else seed
        eos = token_ids(self.served.eos_id if eos_id is None else eos_id)
        # the stop tokens are exactly eos (ignore_eos: not also the one vLLM reads from the model's config)
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                                 seed=(base + i * _PHI) % 2**63, logprobs=0, stop_token_ids=eos, ignore_eos=True,
                                 detokenize=False)
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = self.served.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        seconds = time.perf_counter() - t0
        results = [_result(o.outputs[0]) for o in outs]
        self.stats = _stats(self.gamma, [o.outputs[0].spec_decode_metrics for o in outs], results, seconds)
        if progress is not None:
            progress(len(prompts))
        return results

def _result(c) -> GenerationResult:
    """A vLLM completion as codraft's result: "stop" is a stop token (EOS), which vLLM keeps in token_ids."""
    tokens = list(c.token_ids)
    logprobs = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
    return GenerationResult(tokens, logprobs, "eos" if c.finish_reason == "stop" else "length")


def _stats(gamma: int, per_request, results: list[GenerationResult], seconds: float) -> SpecStats:
    """SpecStats of a call from each request's acceptance histogram (histogram[j]: steps accepting j drafts)."""
    s = SpecStats(gamma=gamma, emitted_tokens=sum(len(r.tokens) for r in results), total_s=seconds,
                  verify_s=seconds)
    hist = [0] * (gamma + 1)
    for m in per_request:
        if m is None:  # (plain decoding, or a request that finished at its prefill)
            continue
        s.drafted += m.num_draft_tokens
        for j, n in enumerate(m.histogram):
            hist[j] += n
    if gamma:
        s.row_rounds = s.rounds = sum(hist)
        s.accepted = sum(j * n for j, n in enumerate(hist))
        s.accepted_per_position = [sum(hist[k:]) for k in range(1, gamma + 1)]
        s.drafted_per_position = [s.row_rounds] * gamma
        s.gamma_chosen = [0] * gamma + [s.row_rounds]
    else:
        s.rounds = s.row_rounds = sum(max(len(r.tokens) - 1, 0) for r in results)
    return s
