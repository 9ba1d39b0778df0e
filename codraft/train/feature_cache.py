"""Target features computed once: what offline draft training reads, with no target forward per step.

``build`` samples completions from the target with the rollout engine (temperature 1, like RL
rollouts) on the task's training prompts as the run renders them (a data file's own ids), runs the
target once over them in packed chunks (no grad) and keeps, for every token,
the tapped layer outputs and the last layer's output (before the final norm). Teacher logits
are the frozen, shared LM head applied to that last output: ``batch`` computes them for the rows
a draft reads only, so the (tokens, vocab) logits are never stored. A draft that predicts K tokens
of the vocabulary gets their log-probabilities only: the head's K rows per step, and each row's
logsumexp over the whole vocabulary once per cache (``teacher_lse``).

A cache records what it was made from (``identity``: policy, task and its knobs, sampling, taps);
``load`` refuses one made from another policy or task, naming both. ``cached`` builds on first
use and writes the folder atomically, so an interrupted build leaves nothing that looks done; what it
had sampled (minutes for the real model) is kept beside it, and the next build continues from there.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from codraft.atomic import atomic_dir, atomic_write_text, build_lock
from codraft.cache import cache_root
from codraft.drafts import DraftBatch
from codraft.drafts.batch import supervised_rows
from codraft.models.layers import linear
from codraft.models.tensor_files import load_pickle
from codraft.rollout import Engine
from codraft.train.packing import pack

FORMAT = 1  # bump when the stored layout changes
SAMPLE_BATCH = 64  # prompts per engine call while sampling (and per batch kept from an interrupted build)


@dataclass
class FeatureCache:
    identity: dict                                # what the cache was made from, see ``identity``
    sequences: list[tuple[list[int], list[int]]]  # (prompt ids, completion ids)
    features: dict[int, torch.Tensor]             # layer -> (N,H): every token of every sequence, back to back
    last: torch.Tensor                            # (N,H) the last decoder layer's output, before the final norm

    def __post_init__(self):
        lens = torch.tensor([len(p) + len(c) for p, c in self.sequences])
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])  # (n+1,)
        self._lse = None  # (key of the head it was computed with, (N,) logsumexp), see teacher_lse

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.features))

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, policy, indices: list[int], layers: tuple[int, ...], teacher: bool = True,
              columns: torch.Tensor | None = None) -> DraftBatch:
        """The ``DraftBatch`` of sequences ``indices`` packed in that order, on the policy's device;
        teacher logits from ``policy.logits`` (final norm + LM head) on the supervised rows only;
        with ``columns`` (K,) token ids only their log-probabilities (``DraftBatch.teacher_tokens``);
        with ``teacher`` False (a draft that does not read them) on no row."""
        missing = sorted(set(layers) - set(self.features))
        if missing:
            raise ValueError(f"the feature cache holds layers {list(self.layers)}, the draft reads {list(layers)} "
                             f"(missing {missing}): build a cache with its taps")
        dev = policy.head_weight.device
        seqs = [self.sequences[i] for i in indices]
        p = pack([s[0] for s in seqs], [s[1] for s in seqs], device=dev, share_prompts=False)
        flat = torch.cat([torch.arange(self.offsets[i], self.offsets[i + 1]) for i in indices])
        rows = supervised_rows(p.completion)
        if not teacher:
            rows = rows[:0]
        at = flat[rows.cpu()]
        with torch.no_grad():
            if columns is None:
                logits = policy.logits(self.last[at].to(dev))
            else:
                columns = columns.to(dev)
                head = policy.head_weight.index_select(0, columns)
                lse = self.teacher_lse(policy)[at, None].to(dev)
                logits = linear(policy.norm(self.last[at].to(dev)), head).float() - lse
        feats = {l: self.features[l][flat][None].to(dev) for l in layers}
        return DraftBatch(p.input_ids, p.cu_seqlens, p.completion, feats, logits, rows, teacher_tokens=columns)

    def teacher_lse(self, policy) -> torch.Tensor:
        """(N,) the logsumexp over the whole vocabulary of ``policy``'s logits at every cached row a
        completion token follows (the rows a batch's teacher can be; NaN at the others): computed on
        first use, again if the head changes (~25k SmolLM2 rows: ~15 s on 2 cores). 64 rows at a time, as
        ``DSparkDraft._teacher`` takes its logsumexp: the (rows x V) logits stay in cache (256 rows: ~30 %
        slower on a 2-core EPYC)."""
        w, n = policy.head_weight, policy.norm.weight
        key = (w.data_ptr(), _version(w), n.data_ptr(), _version(n))
        if self._lse is None or self._lse[0] != key:
            rows = torch.cat([torch.arange(o + len(p) - 1, o + len(p) + len(c) - 1)
                              for (p, c), o in zip(self.sequences, self.offsets.tolist())])
            lse = torch.full((len(self.last),), float("nan"))
            with torch.no_grad():
                for i in range(0, len(rows), 64):
                    r = rows[i:i + 64]
                    lse[r] = policy.logits(self.last[r].to(w.device)).float().logsumexp(-1).cpu()
            self._lse = (key, lse)
        return self._lse[1]

    # ------------------------------------------------------------ disk

    def save(self, folder: str | os.PathLike) -> Path:
        with atomic_dir(folder) as tmp:
            torch.save({"sequences": self.sequences, "features": self.features, "last": self.last}, tmp / "tensors.pt")
            (tmp / "identity.json").write_text(json.dumps(self.identity, indent=2, sort_keys=True))
        return Path(folder)

    @classmethod
    def load(cls, folder: str | os.PathLike, expect: dict | None = None) -> "FeatureCache":
        """Read a saved cache; with ``expect`` (an ``identity``), refuse one made from another policy,
        task, sampling or format, naming what differs."""
        folder = Path(folder)
        if not (folder / "identity.json").is_file():
            raise FileNotFoundError(f"{folder} is not a feature cache (no identity.json)")
        identity = json.loads((folder / "identity.json").read_text())
        if expect is not None:
            check_identity(identity, expect, folder)
        state = load_pickle(folder / "tensors.pt")  # never unpickle code from a folder
        return cls(identity, [(list(p), list(c)) for p, c in state["sequences"]],
                   {int(l): f for l, f in state["features"].items()}, state["last"])


def _version(t: torch.Tensor) -> int | None:
    """How many in-place changes t has seen; None for an inference-mode tensor, which counts none."""
    try:
        return t._version
    except RuntimeError:
        return None


def identity(*, policy_name: str, policy_key: str, task, n_prompts: int, max_new_tokens: int, seed: int,
             temperature: float, layers) -> dict:
    """What a cache is made from; two caches with equal identities hold the same data. JSON-normal
    (tuples as lists), so it compares equal to itself read back from disk."""
    return json.loads(json.dumps({"format": FORMAT, "policy": policy_name, "policy_key": policy_key, "task": task.name,
            "task_knobs": task.problem_knobs, "n_prompts": n_prompts, "max_new_tokens": max_new_tokens, "seed": seed,
            "temperature": temperature, "layers": sorted(int(l) for l in layers)}))


def check_identity(found: dict, expect: dict, folder) -> None:
    """Refuse a cache whose policy, task or recipe differs from the one asked for, naming both."""
    if (found.get("policy"), found.get("policy_key")) != (expect["policy"], expect["policy_key"]):
        raise ValueError(f"feature cache {folder} was made from policy {found.get('policy')!r} "
                         f"(weights {found.get('policy_key')}), not {expect['policy']!r} (weights {expect['policy_key']})")
    if (found.get("task"), found.get("task_knobs")) != (expect["task"], expect["task_knobs"]):
        raise ValueError(f"feature cache {folder} was made from task {found.get('task')!r} {found.get('task_knobs')}, "
                         f"not {expect['task']!r} {expect['task_knobs']}")
    differ = sorted(k for k in expect if k != "layers" and found.get(k) != expect[k])
    if differ:
        raise ValueError(f"feature cache {folder} differs in {', '.join(differ)}: "
                         + "; ".join(f"{k} {found.get(k)!r} != {expect[k]!r}" for k in differ))
    missing = sorted(set(expect["layers"]) - set(found.get("layers", [])))
    if missing:
        raise ValueError(f"feature cache {folder} holds layers {found.get('layers')}, not {missing}")


# ---------------------------------------------------------------- building


def prompt_ids(tok, problem) -> list[int]:
    """The ids a run decodes ``problem`` from: rendered at load where the task did it (your data files: chat
    template, system prompt), else the tokenizer's."""
    return problem.prompt_ids if problem.prompt_ids is not None else tok.prompt_ids(problem.prompt)


def sample_sequences(policy, tok, task, *, n_prompts: int, max_new_tokens: int, seed: int,
                     temperature: float = 1.0, progress: bool = True, keep: Path | None = None,
                     on_first_batch: Callable[[list, float, int], None] | None = None
                     ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) pairs sampled from the target on the task's train prompts, rendered as
    the run renders them (``prompt_ids``). With ``keep`` (a JSON file), the pairs so far are written there
    after every batch, and a build that was interrupted continues after the last batch written: each batch
    has its own seed, so the result is the uninterrupted one's (the real model's sampling takes minutes).
    on_first_batch(pairs so far, seconds the batch took, batches left): called once, after the first batch
    sampled here (what a build's time estimate is measured on)."""
    engine, batch = Engine(policy), SAMPLE_BATCH
    problems = task.sample("train", n_prompts, seed=seed + 17)
    out = _kept(keep, batch)
    bar = tqdm(total=-(-n_prompts // batch), initial=len(out) // batch, desc="sample completions",
               disable=not progress, dynamic_ncols=True)
    for i in range(len(out), n_prompts, batch):
        t0 = time.perf_counter()
        prompts = [prompt_ids(tok, p) for p in problems[i:i + batch]]
        res = engine.generate(prompts, max_new_tokens, temperature=temperature, seed=seed + i, eos_id=tok.eos_id)
        out += [(p, r.tokens) for p, r in zip(prompts, res)]
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(keep, json.dumps({"batch": batch, "sequences": out}))
        bar.update()
        if on_first_batch is not None:
            on_first_batch(out, time.perf_counter() - t0, -(-(n_prompts - len(out)) // batch))
            on_first_batch = None
    bar.close()
    return out


def _kept(keep: Path | None, batch: int) -> list:
    """The pairs an interrupted sampling wrote to ``keep`` (whole batches of ``batch``), or []."""
    if keep is None or not keep.is_file():
        return []
    try:
        d = json.loads(keep.read_text())
        out = [(list(p), list(c)) for p, c in d["sequences"]]
        if d["batch"] != batch or len(out) % batch:
            raise ValueError(f"{len(out)} pairs in batches of {d['batch']}, not whole batches of {batch}")
    except (OSError, ValueError, LookupError, TypeError) as e:
        warnings.warn(f"codraft: {keep} unusable ({type(e).__name__}: {e}): sampling from the start", stacklevel=3)
        return []
    print(f"codraft: {len(out)} sampled completions kept from an interrupted build ({keep}), continuing",
          file=sys.stderr, flush=True)
    return out


@torch.no_grad()
def target_features(policy, sequences, layers, *, chunk_tokens: int = 4096,
                    progress: bool = True) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The target over the sequences in packed chunks: ({layer: (N,H)}, last (N,H)) on the CPU."""
    dev = policy.head_weight.device
    chunks, cur, size = [], [], 0
    for s in sequences:  # consecutive sequences up to ``chunk_tokens`` per forward
        n = len(s[0]) + len(s[1])
        if cur and size + n > chunk_tokens:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    chunks += [cur] if cur else []
    feats: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    last = []
    for chunk in tqdm(chunks, desc="target features", disable=not progress, dynamic_ncols=True):
        p = pack([s[0] for s in chunk], [s[1] for s in chunk], device=dev, share_prompts=False)
        hidden, tapped = policy(p.input_ids, cu_seqlens=p.cu_seqlens, taps=tuple(layers), head=False)
        last.append(hidden[0].cpu())
        for l in layers:
            feats[l].append(tapped[l][0].cpu())
    return {l: torch.cat(f) for l, f in feats.items()}, torch.cat(last)


def build(policy, tok, task, *, layers, n_prompts: int, max_new_tokens: int, seed: int, temperature: float = 1.0,
          ident: dict, progress: bool = True, keep: Path | None = None,
          on_first_batch: Callable[[list, float, int], None] | None = None) -> FeatureCache:
    """Sample, then run the target (``keep``, ``on_first_batch``: see ``sample_sequences``)."""
    policy.eval()
    seqs = sample_sequences(policy, tok, task, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed,
                            temperature=temperature, progress=progress, keep=keep, on_first_batch=on_first_batch)
    feats, last = target_features(policy, seqs, sorted(layers), progress=progress)
    return FeatureCache(ident, seqs, feats, last)


def cached(policy, tok, task, *, policy_name: str, policy_key: str, layers, n_prompts: int, max_new_tokens: int,
           seed: int, temperature: float = 1.0, progress: bool = True,
           on_first_batch: Callable[[list, float, int], None] | None = None) -> FeatureCache:
    """The cache for these settings under ``cache_root()/features``, built and saved on first use
    (``on_first_batch``: see ``sample_sequences``; not called when nothing is sampled)."""
    ident = identity(policy_name=policy_name, policy_key=policy_key, task=task, n_prompts=n_prompts,
                     max_new_tokens=max_new_tokens, seed=seed, temperature=temperature, layers=layers)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root() / "features" / f"{task.name}-{key}"
    if (folder / "identity.json").is_file():
        return FeatureCache.load(folder, expect=ident)
    with build_lock(folder.with_name(f".{folder.name}.lock"), f"the feature cache {folder}"):
        if (folder / "identity.json").is_file():  # built by another process while this one waited
            return FeatureCache.load(folder, expect=ident)
        keep = folder.with_name(folder.name + ".sampled.json")  # what an interrupted build had sampled
        cache = build(policy, tok, task, layers=layers, n_prompts=n_prompts, max_new_tokens=max_new_tokens,
                      seed=seed, temperature=temperature, ident=ident, progress=progress, keep=keep,
                      on_first_batch=on_first_batch)
        cache.save(folder)
        keep.unlink(missing_ok=True)
    return cache
