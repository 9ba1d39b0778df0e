"""Will the run fit? Its prompts against the policy's context, its step against the machine's memory.

``check_run`` runs before the trainer loads or creates anything: from the policy's config.json and
tokenizer (``codraft.policy.resolve.policy_config``, no weights) and a sample of a built-in task's prompts
(a data file's: every row, rendered as the run renders them),
  * a prompt + ``rollout.max_new_tokens`` longer than the policy's context (max_position_embeddings)
    is refused naming the task, the longest prompt and the context (``check_context``; the trainer
    checks every step's prompts again);
  * ``estimate`` counts the bytes a step holds at its peak on one rank and the refusal names the keys
    to lower when that exceeds the memory available (CPU: MemAvailable, shared by the ranks of this
    machine; CUDA: the device's free memory). ``memory_check=false`` skips it: the estimate takes every
    completion at ``rollout.max_new_tokens``, an upper bound a run with short completions stays under.

What ``estimate`` counts (bytes, one rank; e = the policy dtype's bytes):
  weights  the policy, its gradients and two Adam moments (a stage's own under parallel.pp), the KL
           reference and the bf16 rollout copy when used, the draft's the same way;
  rollout  the largest ``Engine.generate`` call (a shard of whole groups, or the validation batch): per
           row the KV caches of the policy and the draft over prompt + max_new + γ + 1 positions, the
           prefill's tapped features, a verify round's logits, probabilities and activations, the outputs;
  train    one update over the largest micro-batch (its groups' prompts packed once), times the
           micro-batches 1F1B keeps in flight: the activations the policy's layers keep for the backward
           (``_layer_floats``), its logits and their gradient, the reference's forward, and the draft loss
           (its block / TTT / sequence tokens at two layers' worth each, its tapped features); each rank's
           share of the row under parallel.cp, of the layers under parallel.pp, of the products' activations
           under parallel.tp (and of the residual stream's with parallel.sequence_parallel; `codraft bench tp`
           measures both splits);
  host     the step's prompts and results as Python lists.
The peak is weights + max(rollout, train) + host. tests/integration/test_memory.py compares it with measured steps.

``out_of_memory`` is the one-line error for an allocation that fails anyway (the trainer removes the
run folder when no step completed, so it does not block a rerun).
"""
from __future__ import annotations

import itertools
import math
import os
import warnings
from dataclasses import dataclass

import torch

from codraft.data import build_task
from codraft.errors import CodraftError
from codraft.eval.evaluate import problem_ids
from codraft.models import ModelConfig
from codraft.parallel.layout import Layout
from codraft.policy.resolve import policy_config
from codraft.tasks import make_task

GiB = 2**30
F32 = 4
# CPython objects per token: a prompt's list slot and int; a result's token and logprob (slots, int, float)
HOST_PROMPT_TOKEN, HOST_RESULT_TOKEN = 36, 68
# the drafts' own defaults (codraft.drafts: dflash/dspark.build num_anchors and loss_chunk_blocks, eagle3.build
# ttt_steps and its taps); every kind's default depth is one layer at the policy's width
DRAFT_ANCHORS, DRAFT_CHUNK_BLOCKS, EAGLE3_TTT_STEPS, EAGLE3_TAPS = 128, 256, 7, 3


class ContextError(CodraftError, ValueError):
    """A prompt and its new tokens do not fit the policy's context."""


class OutOfMemory(CodraftError, RuntimeError):
    """The step does not fit the memory: refused before the run, or an allocation failed in it."""


def _lower(cfg) -> str:
    r, p = cfg.rollout, cfg.parallel
    return (f"lower rollout.group_size={r.group_size}, rollout.prompts_per_step={r.prompts_per_step} or "
            f"rollout.max_new_tokens={r.max_new_tokens}, or raise parallel.microbatches={p.microbatches}")


# ---------------------------------------------------------------- the policy's context


def check_context(longest: int, max_new: int, context: int, *, what: str, new_key: str, fix: str) -> None:
    """ContextError when a prompt of ``longest`` tokens + ``max_new`` new ones exceeds ``context`` positions."""
    if longest + max_new > context:
        raise ContextError(f"{what} has {longest} tokens + {new_key}={max_new} = {longest + max_new} > the "
                           f"model's context of {context} positions (max_position_embeddings); {fix}")


def fit_context(prompts: list[list[int]], max_new: int, context: int, truncate: str | None):
    """`codraft generate`'s prompts against the context: refused (ContextError) or, truncate="left", cut to
    their last context - max_new tokens. -> (prompts, the original length of each one cut)."""
    room = context - max_new
    if room < 1:
        raise ContextError(f"--max-new-tokens {max_new} leaves no room for a prompt in the model's context of "
                           f"{context} positions (max_position_embeddings)")
    cut = {}
    for i, p in enumerate(prompts):
        if len(p) <= room:
            continue
        if truncate != "left":
            check_context(len(p), max_new, context, what=f"--prompt {i + 1}", new_key="--max-new-tokens",
                          fix=f"shorten it, lower --max-new-tokens, or pass --truncate-prompt left to keep its last "
                              f"{room} tokens")
        cut[i] = len(p)
        prompts[i] = p[len(p) - room:]
    return prompts, cut


# ---------------------------------------------------------------- the estimate


def _heads(m: ModelConfig) -> tuple[int, int]:
    return m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim


def _layer_floats(m: ModelConfig, tp: int = 1, sequence: bool = False) -> float:
    """Values one decoder layer keeps for the backward per token (on one of ``tp`` tensor-parallel ranks,
    ``sequence``: with sequence parallelism): the norms' inputs and outputs and the residual (~5 H; split only
    by sequence parallelism), the MLP's gate, up, SiLU and product (4 I; split but for MoE layers, whose
    experts every rank holds whole), q, its RoPE'd copy, the attention output and the o_proj input (4 Q), k and
    v (2 K) (split: each rank's heads)."""
    q, k = _heads(m)
    mlp = 4 * m.intermediate_size / (1 if getattr(m, "num_experts", 0) else tp)
    return 5 * m.hidden_size / (tp if sequence else 1) + mlp + (4 * q + 2 * k) / tp


def _layer_params(m: ModelConfig) -> int:
    q, k = _heads(m)
    return m.hidden_size * (2 * q + 2 * k) + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size


def _params(m: ModelConfig) -> int:
    head = 1 if m.tie_word_embeddings else 2
    return m.vocab_size * m.hidden_size * head + m.num_hidden_layers * _layer_params(m) + m.hidden_size


@dataclass
class _Draft:
    """A draft kind's shape, for the estimate."""
    taps: int = 0               # policy layers tapped (features in the prefill and the loss)
    kv_layers: int = 0          # layers of KV cache it keeps in the rollout
    params: int = 0
    tokens: int = 0             # tokens its loss runs per sequence
    floats: int = 0             # values each keeps for the backward
    chunk: int = 0              # values of the head temporaries alive at once (block drafts: one chunk)


def _draft(cfg, m: ModelConfig, prompt_len: int) -> _Draft | None:
    d, M = cfg.draft, cfg.rollout.max_new_tokens
    if d.mode == "none":
        return None
    if d.kind == "ngram":
        return _Draft()
    a, layer, h, v = _layer_floats(m), _layer_params(m), m.hidden_size, m.vocab_size
    if d.kind in ("dflash", "dspark"):
        slots = d.gamma + (d.kind == "dflash")  # a DFlash block has the anchor and γ drafts, DSpark γ slots
        blocks = min(d.num_anchors or DRAFT_ANCHORS, M)  # anchors are completion tokens
        step_blocks = cfg.rollout.prompts_per_step * cfg.rollout.group_size * blocks
        return _Draft(1, 1, layer + h * h, blocks * slots, 2 * a, 4 * min(step_blocks, DRAFT_CHUNK_BLOCKS) * slots * v)
    if d.kind == "eagle3":
        taps = min(EAGLE3_TAPS, m.num_hidden_layers)
        return _Draft(taps, 1, layer + taps * h * h, EAGLE3_TTT_STEPS * (prompt_len + M), 2 * a + 3 * v)
    # model: a separate one-layer decoder with its own embedding and head, over every token
    return _Draft(0, 1, layer + 2 * v * h, prompt_len + M, a + 5 * h + 3 * v)


@dataclass
class Estimate:
    """Bytes at the peak of a step on one rank (see the module doc)."""
    weights: int
    rollout: int
    train: int
    host: int

    @property
    def peak(self) -> int:
        return self.weights + max(self.rollout, self.train) + self.host

    def __str__(self) -> str:
        return (f"weights {self.weights / GiB:.2f} + max(rollout {self.rollout / GiB:.2f}, update "
                f"{self.train / GiB:.2f}) + host {self.host / GiB:.2f} GiB")


def rollout_bytes(m: ModelConfig, rows: int, distinct: int, prompt_len: int, max_new: int, gamma: int,
                  draft: _Draft | None, e: int) -> int:
    """One ``Engine.generate`` call of ``rows`` rows (``distinct`` prompts, prefilled once each)."""
    q, k = _heads(m)
    h, i, v = m.hidden_size, m.intermediate_size, m.vocab_size
    draft = draft or _Draft()
    ctx = prompt_len + max_new + gamma + 1  # the cache's positions (codraft.rollout.engine.Rollout)
    kv = 2 * (m.num_hidden_layers + draft.kv_layers) * k * ctx * e
    taps = draft.taps * prompt_len * h * e  # the prefill's features, copied to every row
    # a verify round: the target's logits and probabilities, the draft's logits and q, the residual; its
    # activations and attention scores over the cache; the outputs (token, logprob)
    rnd = 5 * (gamma + 1) * v * F32 + (gamma + 1) * (2 * i + 4 * h + m.num_attention_heads * ctx) * F32
    out = (max_new + gamma + 1) * (8 + 4 + 8)
    prefill = distinct * prompt_len * (2 * i + 4 * h + q + 2 * k) * e
    return rows * (kv + taps + rnd + out) + prefill


def estimate(cfg, m: ModelConfig, prompt_len: int, val_prompt_len: int = 0) -> Estimate:
    """The step's peak on one rank for config ``cfg``, policy config ``m`` and the longest prompt (tokens) of
    the training and validation prompts."""
    r, par, g = cfg.rollout, cfg.parallel, cfg.grpo
    e = 2 if cfg.policy.dtype == "bfloat16" else F32
    G, P, M = r.group_size, r.prompts_per_step, r.max_new_tokens
    layout = Layout.of(par)
    ranks = layout.world
    draft = _draft(cfg, m, prompt_len)
    gamma = cfg.draft.gamma if draft is not None else 0
    trains = draft is not None and cfg.draft.mode == "cotrain" and draft.params > 0

    n = _params(m)
    # the weights, their gradients and Adam moments: a stage's, or (FSDP) a 1/(dp·cp) shard of them (of the
    # stage's under pp) plus the gathered layer, each split over tp (taken as all of them: MoE experts and
    # the norms are not); then the rollout engine decodes from a whole copy (the refit)
    gathered = layout.gathers  # the trainer's models wrapped by FSDP2 or split, the engine's a whole copy
    if gathered and par.dp_shard == "fsdp":
        weights = (n * e + 3 * n * F32) // ranks + _layer_params(m) * e // par.tp
    else:
        weights = (n * e + 3 * n * F32 // par.pp) // par.tp
    weights += n * e if g.kl_coef > 0 else 0
    weights += n * (2 if r.dtype == "bfloat16" else e) if gathered else \
        (n * 2 if r.dtype == "bfloat16" and e == F32 else 0)
    if draft is not None:
        weights += draft.params * F32 * (4 if trains else 1) * (2 if cfg.log.frozen_probe_every else 1)

    shard = math.ceil(P / (r.shards or ranks))  # groups one generate call decodes
    rollout = rollout_bytes(m, shard * G, shard, prompt_len, M, gamma, draft, e)
    if cfg.log.val_every:
        rollout = max(rollout, rollout_bytes(m, cfg.log.val_size, cfg.log.val_size, val_prompt_len, M, gamma,
                                             draft, e))

    groups = math.ceil(P / (par.microbatches * par.dp))  # the largest micro-batch (a DP rank's share)
    seqs = groups * G
    row = groups * (prompt_len + G * M) / par.cp  # the policy's packed row: each group's prompt once
    completions = seqs * M / par.cp
    in_flight = min(par.pp, par.microbatches)
    layers = math.ceil(m.num_hidden_layers / par.pp) + 1  # + the layer whose backward runs
    a = _layer_floats(m, par.tp, par.sequence_parallel)
    train = in_flight * row * (layers * a + 5 * m.hidden_size) * e
    # logits, scaled, and their gradients (split over tp), and the draft's whole teacher rows
    train += (3 / par.tp + 1) * completions * m.vocab_size * F32
    if g.kl_coef > 0:  # the reference's forward: one layer at a time, and its logits
        train += row * _layer_floats(m) * e + 2 * completions * m.vocab_size * F32  # (whole on every rank)
    if trains:
        train += draft.taps * seqs * (prompt_len + M) / par.cp * m.hidden_size * F32  # taps per sequence
        train += seqs * draft.tokens / par.cp * draft.floats * F32 + draft.chunk * F32

    host = P * G * (prompt_len * HOST_PROMPT_TOKEN + M * HOST_RESULT_TOKEN)
    return Estimate(int(weights), int(rollout), int(train), int(host))


# ---------------------------------------------------------------- what the machine has


def available(device: str) -> tuple[int, str] | None:
    """(bytes this process may still allocate on ``device``, where they were read), or None where unknown."""
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.mem_get_info(d)[0], f"{d} has"
    if d.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine has"
    except OSError:
        pass
    return None


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` -> ``peak.bytes``: what the block added at its peak on
    ``device``: the CUDA allocator's peak above its start, or on Linux the resident high-water mark
    (VmHWM, reset at the start: process-wide, so not around code that another measurement spans) above
    the resident size at the start; None where neither can be read."""

    def __init__(self, device: str):
        self.device, self.base, self.bytes = torch.device(device), None, None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            if reset_resident_peak():
                self.base = proc_status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.base is not None:
            top = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else proc_status("VmHWM")
            self.bytes = max(top - self.base, 0)


def reset_resident_peak() -> bool:
    """Reset this process's resident high-water mark (VmHWM) to its current size; False where Linux's
    /proc/self/clear_refs cannot be written."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status(key: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes (0 where the key is absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def check_memory(cfg, m: ModelConfig, prompt_len: int, val_prompt_len: int = 0) -> Estimate:
    """OutOfMemory (one line: estimate, available, the keys to lower) when the step cannot fit."""
    est = estimate(cfg, m, prompt_len, val_prompt_len)
    have = available(cfg.device)
    if have is None:
        warnings.warn(f"memory check skipped: no way to read the memory available on device={cfg.device} (the "
                      f"step is estimated at {est.peak / GiB:.1f} GiB per rank)", stacklevel=3)
        return est
    free, where = have
    # the ranks of a CPU run share this machine's memory (torchrun sets LOCAL_WORLD_SIZE)
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(cfg.device).type == "cpu" else 1
    need = est.peak * procs
    if need > free:
        each = f" ({procs} ranks × {est.peak / GiB:.1f})" if procs > 1 else ""
        raise OutOfMemory(f"the run needs ~{need / GiB:.1f} GiB{each} at its step's peak ({est}) but {where} "
                           f"{free / GiB:.1f} GiB available; {_lower(cfg)}; or set memory_check=false (the "
                           f"estimate takes every completion at rollout.max_new_tokens)")
    return est


def check_run(cfg) -> None:
    """The prompts against the policy's context, then the step against the memory (``memory_check``), from the
    policy's config and the task's prompts: no weights are read and nothing is created. A built-in task's
    prompts: a sample (a step's and the validation's); a data file's (``data.train``): every row, rendered as
    the run renders them (a file's longest prompt may come up at any step; a prompt past the context is the
    file's DataError, naming its row)."""
    m, tok = policy_config(cfg.policy.init)
    r = cfg.rollout
    if cfg.data.train:
        task = build_task(cfg, tok, m.max_position_embeddings)
        train_problems = task.train
    else:
        task = make_task(cfg.task.name, max_chars=cfg.task.max_chars, format_reward=cfg.task.format_reward)
        train_problems = itertools.islice(task.stream("train", seed=cfg.seed), r.prompts_per_step)
    train = max(len(problem_ids(tok, p)) for p in train_problems)
    val = max(len(problem_ids(tok, p)) for p in task.sample("val", cfg.log.val_size, seed=cfg.seed)) \
        if cfg.log.val_every else 0
    check_prompts(task.name, max(train, val), r.max_new_tokens, m.max_position_embeddings, cfg.policy.init)
    if cfg.memory_check:
        check_memory(cfg, m, train, val)


def check_prompts(task: str, longest: int, max_new: int, context: int, policy: str) -> None:
    """ContextError naming the task when its longest prompt + rollout.max_new_tokens exceeds the context."""
    check_context(longest, max_new, context, what=f"task {task!r}: its longest prompt",
                  new_key="rollout.max_new_tokens",
                  fix=f"lower rollout.max_new_tokens or choose a task with shorter prompts for policy.init={policy}")


# ---------------------------------------------------------------- an allocation that fails anyway


def is_out_of_memory(e: BaseException) -> bool:
    """torch's CPU and accelerator allocators' failures, and Python's own."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def out_of_memory(cfg, e: BaseException, step: int, removed: str | None) -> OutOfMemory:
    lines = str(e).strip().splitlines()
    what = lines[0] if lines else type(e).__name__
    what = what[max(what.find("DefaultCPUAllocator"), 0):][:200]  # past torch's "[enforce fail at ...]"
    tail = f"; {removed} was removed (no step had completed): rerun with the same run_dir=" if removed else ""
    return OutOfMemory(f"step {step}: out of memory ({what}); {_lower(cfg)}{tail}")
