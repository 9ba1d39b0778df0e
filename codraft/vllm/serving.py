"""The folders vLLM loads and the ``LLM`` built from them.

vLLM loads a model only from a folder: the policy as ``save_pretrained`` writes it (HF format) and the draft as
``codraft export-draft --stack vllm`` writes it (EAGLE-3's public layout, no d2t/t2d for a full vocabulary,
which vLLM refuses; DFlash's, a learned MASK vector fed as ``mask_token``'s id and written to
mask_embedding.pt). Both go to a temporary folder that is removed once the engines are built: after that the
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
import gc
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from codraft.export.source import EXPORT_MARK
from codraft.export.write import export_draft
from codraft.models import save_pretrained
from codraft.rollout.engine import token_ids


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
    export_draft(folder / "draft-source", folder / "draft", target=str(folder / "policy"), stack="vllm",
                 mask_token_id=mask_token(policy.config) if learned_mask(draft) else None)
    return folder / "policy", folder / "draft"


def learned_mask(draft) -> bool:
    """A DFlash draft whose MASK input is its own learned vector (codraft's default), not a target row."""
    return getattr(draft, "mask_embedding", None) is not None


def mask_token(config) -> int:
    """The token id vLLM feeds a learned MASK vector as: the policy's pad token unless it is an EOS, else its
    last vocabulary row. vLLM's DFlash substitutes the vector for every draft input of that id, so a real token
    of that id drafts worse (never wrongly: the target verifies every draft): a token the policy rarely emits
    is best."""
    pad = config.pad_token_id
    return pad if pad is not None and pad not in token_ids(config.eos_token_id) else config.vocab_size - 1


def method(draft) -> str:
    """vLLM's speculative method for an exported draft: its folder's ``codraft_export`` kind (eagle3, dflash)."""
    return json.loads((draft / "config.json").read_text())[EXPORT_MARK]["kind"]


def build(policy_dir: Path, draft_dir: Path | None, *, gamma: int, dtype: str, max_len: int, max_rows: int,
          vocab_size: int, eos_id, seed: int) -> Served:
    """An in-process vLLM ``LLM`` over the folders (``draft_dir`` None: plain decoding)."""
    from vllm import LLM

    spec = {} if draft_dir is None else dict(
        speculative_config={"method": method(draft_dir), "model": str(draft_dir), "num_speculative_tokens": gamma},
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


def shut_down(served: Served) -> None:
    """Free an engine's memory while the process's other engines keep running. vLLM's own shutdown
    (``EngineCore.shutdown``, also run when its in-process client is collected) ends vLLM's distributed state,
    which every engine of the process shares (measured: the next engine's step fails, "pipeline model parallel
    group is not initialized"); its engine start ``gc.freeze``s what it allocated, so nothing is freed before
    ``gc.unfreeze``. So: its executor and scheduler shut down, the client's finalizer detached, the objects
    unfrozen and collected."""
    client = served.llm.llm_engine.engine_core  # (in process: an InprocClient)
    client._finalizer.detach()
    client.engine_core.model_executor.shutdown()
    client.engine_core.scheduler.shutdown()
    served.llm = None
    gc.unfreeze()
    gc.collect()
