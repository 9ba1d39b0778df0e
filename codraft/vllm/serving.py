"""The folders vLLM loads and the ``LLM`` built from them.

vLLM loads a model only from a folder: the policy as ``save_pretrained`` writes it (HF format) and the draft as
``codraft export-draft --stack vllm`` writes it (EAGLE-3's public layout, no d2t/t2d for a full vocabulary,
which vLLM refuses). Both go to a temporary folder that is removed once the engines are built: after that the
weights only ever arrive in place (refit.py).

The ``LLM``: in this process (environment.py), no tokenizer (prompts and outputs are token ids), eager (no
torch.compile: 80 s of compilation, and bf16 logprobs that differ slightly from eager), the trainer's dtype
or rollout.dtype, ``logprobs_mode="processed_logprobs"`` (the logprob of each sampled token after temperature
and top-k/top-p: codraft's convention, codraft.spec.sampling; at greedy the raw log_softmax, as codraft), and
per-request speculative statistics (``per_request_spec_decode_metrics="summary"``): the engine-wide counters
of ``LLM.get_metrics()`` live in one Prometheus registry per process, which the next ``LLM`` built resets.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from codraft.export.write import export_draft
from codraft.models import save_pretrained


@dataclass
class Served:
    """One vLLM engine: the ``LLM`` and what it was built with."""
    llm: object                 # vllm.LLM
    gamma: int                  # tokens drafted per round (0: plain decoding)
    dtype: str                  # float32 or bfloat16
    max_len: int                # prompt + new tokens, at most
    vocab_size: int
    eos_id: int | list[int] | None  # the policy's (config.json)
    version: int = 0            # the trainer's update whose weights it holds (the backend counts them)

    @property
    def worker(self):
        """The in-process worker (VLLM_ENABLE_V1_MULTIPROCESSING=0): its model and drafter."""
        return self.llm.llm_engine.model_executor.driver_worker.worker


def write_folders(folder: Path, policy, draft) -> tuple[Path, Path | None]:
    """The policy's HF folder and (a draft given) its vLLM export, under ``folder``."""
    save_pretrained(policy, folder / "policy")
    if draft is None:
        return folder / "policy", None
    draft.save(folder / "draft-source")
    export_draft(folder / "draft-source", folder / "draft", target=str(folder / "policy"), stack="vllm")
    return folder / "policy", folder / "draft"


def build(policy_dir: Path, draft_dir: Path | None, *, gamma: int, dtype: str, max_len: int, max_rows: int,
          vocab_size: int, eos_id, seed: int) -> Served:
    """An in-process vLLM ``LLM`` over the folders (``draft_dir`` None: plain decoding)."""
    from vllm import LLM

    spec = {} if draft_dir is None else dict(
        speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": gamma},
        per_request_spec_decode_metrics="summary")
    with kept_random_state():
        llm = LLM(model=str(policy_dir), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=max_len, max_num_seqs=max_rows, seed=seed, logprobs_mode="processed_logprobs", **spec)
    return Served(llm, gamma if draft_dir is not None else 0, dtype, max_len, vocab_size, eos_id)


@contextlib.contextmanager
def kept_random_state():
    """vLLM in this process seeds Python's, NumPy's and torch's global generators with its own seed: the
    trainer's draws must not depend on whether an engine was built."""
    py, np_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    numpy.random.set_state(np_state)
