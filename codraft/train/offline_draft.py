"""Offline draft training (`codraft train-draft`) and the drafts a run or a command starts from.

Data comes from the target itself, computed once (``codraft.train.feature_cache``): completions
sampled by the rollout engine on the task's training prompts (temperature 1, like RL rollouts)
with the target's tapped features and last hidden state. Each training step packs a few of them
into the same ``DraftBatch`` the co-training step builds (teacher logits = the frozen LM head on
the cached last hidden state), so offline and online training share one loss and no step runs
the target. The result is the starting point of a "frozen" draft and the initial weights for
co-training. Progress is checkpointed (``resume/``, written atomically; each step reseeds from
``step_seed``) so an interrupted run continues where it stopped, with the same draws.

A run's draft (``starting_draft``, ``draft.init=offline``) is trained on the run's own task: your data
files' prompts, or the built-in task. It is cached by policy, data, kind and recipe; a build takes minutes
on a real model, so before it starts, what it builds, on which data, where and how to skip it is said on
stderr, then an estimate of its time measured on the first work done (``_BuildClock``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from codraft.atomic import atomic_dir, build_lock
from codraft.cache import cache_root
from codraft.drafts import Draft, available_drafts, build_draft, draft_kind, init_draft, load_draft
from codraft.models.bf16 import products
from codraft.models.tensor_files import load_pickle
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train import feature_cache
from codraft.train.feature_cache import FeatureCache
from codraft.train.precision import resolve as resolve_precision
from codraft.train.schedule import warmup_cosine
from codraft.train.seeding import step_seed

CACHE_VERSION = 3  # bump when the offline recipe changes: cached drafts of older recipes are not reused


# ---------------------------------------------------------------- training


def train_offline(policy, tok, task, draft: Draft, *, out_dir: str | os.PathLike, steps: int = 200,
                  batch_sequences: int = 16, lr: float = 1e-3, n_prompts: int = 512, max_new_tokens: int = 64,
                  seed: int = 0, checkpoint_every: int = 50, progress: bool = True,
                  features: FeatureCache | None = None, notes: dict | None = None, precision: str = "float32") -> dict:
    """Train ``draft`` on target samples; resumes from ``out_dir/resume``; saves ``out_dir/draft``.

    features: the cached target data to train from (``feature_cache.cached``); None builds it here,
    in memory, from ``n_prompts`` completions of up to ``max_new_tokens``. notes: added to the report.
    precision: the draft's products, "float32", "bfloat16" (bf16 products) or "auto" (``precision.resolve``)."""
    _check_arguments(steps=steps, batch_sequences=batch_sequences, n_prompts=n_prompts,
                     max_new_tokens=max_new_tokens, checkpoint_every=checkpoint_every, lr=lr)
    params = draft.trainable_parameters()
    if not params:
        raise ValueError(f"draft {type(draft).__name__} has no trainable parameters")
    dtype = resolve_precision(precision, draft)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(20, steps, floor=0.1))
    start, history = _restore(out_dir / "resume", draft, opt, sched)
    policy.eval()
    t0 = time.perf_counter()
    if features is None:
        features = feature_cache.build(policy, tok, task, layers=draft.feature_layers, n_prompts=n_prompts,
                                       max_new_tokens=max_new_tokens, seed=seed, ident={}, progress=progress)
    t_data = time.perf_counter() - t0
    layers = tuple(draft.feature_layers)
    bar = tqdm(range(start, steps), desc="train-draft", initial=start, total=steps, disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        s = step_seed(seed, step)
        loss = step_loss(draft, features, policy, random.Random(s).sample(range(len(features)),
                                                                          min(batch_sequences, len(features))),
                         layers, dtype, seed=s)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append(float(loss.detach()))
        bar.set_postfix(loss=f"{history[-1]:.3f}")
        if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            with atomic_dir(out_dir / "resume") as tmp:
                torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step + 1, "history": history}, tmp / "state.pt")
    draft.save(out_dir / "draft")
    report = {"steps": steps, "final_loss": history[-1] if history else None, "data_seconds": t_data,
              "train_seconds": time.perf_counter() - t0 - t_data, "sequences": len(features),
              "features": features.identity, "precision": str(dtype).removeprefix("torch."), **(notes or {})}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))  # written last: marks complete
    shutil.rmtree(out_dir / "resume", ignore_errors=True)
    return report


def step_loss(draft: Draft, features: FeatureCache, policy, indices: list[int], layers, dtype: torch.dtype, *,
              seed: int) -> torch.Tensor:
    """The draft's loss on cached sequences ``indices`` (one training step's forward)."""
    batch = features.batch(policy, indices, tuple(layers), teacher=draft.reads_teacher, columns=draft.teacher_columns())
    torch.manual_seed(seed)
    with products(dtype):
        loss, _ = draft.loss(batch)
    return loss


def _check_arguments(*, lr: float, **counts: int):
    """train_offline's arguments, refused before anything is created: counts >= 1, lr > 0 and finite."""
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"train_offline: {name} must be an int >= 1, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"train_offline: lr must be > 0 and finite, got {lr!r}")


def _restore(folder: Path, draft, opt, sched) -> tuple[int, list[float]]:
    """(first step, loss history) from a ``resume/`` checkpoint, restoring the modules in place."""
    if not (folder / "state.pt").is_file():
        return 0, []
    state = load_pickle(folder / "state.pt")  # never unpickle code from a folder
    draft.load_state_dict(state["draft"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state["step"], state["history"]


# ---------------------------------------------------------------- the drafts runs and commands start from


def default_task_name(tok) -> str:
    """The task a policy's drafts are trained on offline: arith for the char model, chain_sum (the
    real-model preset's task) otherwise."""
    return "arith" if isinstance(tok, CharTokenizer) else "chain_sum"


@dataclass(frozen=True)
class Recipe:
    """How a cached offline draft is trained; part of its cache key."""
    steps: int
    batch_sequences: int
    lr: float
    n_prompts: int
    max_new_tokens: int
    draft_vocab: int = 0  # predict this many tokens (``draft_vocabulary``); 0: all
    precision: str = "float32"  # the draft's products (``precision.resolve``): "auto" measures fp32 against bf16


BLOCK_KINDS = ("dflash", "dspark")  # take a draft vocabulary after they are built (EAGLE-3: when built)


def recipe_for(tok, kind: str) -> Recipe:
    """The char model: 200 short steps for every kind. Real models: sized to fit ~12 minutes per kind
    on 2 CPU cores after the shared feature cache (docs/real-preset.md), on completions as long as
    the real preset's rollouts. Drafts predict 8 192 of the tokens (SmolLM2: 1/6 of 49 152; every
    cached completion token of its task), which makes a block draft's step ~4x cheaper, spent on more
    steps at a higher rate (held-out acceptance still rises at 800 steps), and EAGLE-3's ~5x (its 7
    test-time steps each run its head: 15.7 s a step over the whole vocabulary on a 2-core EPYC,
    26 minutes for its 100 steps; docs/real-preset.md)."""
    if isinstance(tok, CharTokenizer):
        return Recipe(steps=200, batch_sequences=16, lr=1e-3, n_prompts=512, max_new_tokens=64)
    if kind in BLOCK_KINDS and tok.vocab_size > 8192:
        return Recipe(steps={"dflash": 800, "dspark": 700}[kind], batch_sequences=8, lr=2e-3, n_prompts=512,
                      max_new_tokens=128, draft_vocab=8192, precision="auto")
    if kind == "eagle3" and tok.vocab_size > 8192:
        return Recipe(steps=100, batch_sequences=8, lr=1e-3, n_prompts=512, max_new_tokens=128, draft_vocab=8192,
                      precision="auto")
    steps = {"eagle3": 100, "dflash": 200, "dspark": 150}.get(kind, 150)
    return Recipe(steps=steps, batch_sequences=8, lr=1e-3, n_prompts=512, max_new_tokens=128)


def draft_vocabulary(features: FeatureCache, vocab_size: int, k: int) -> tuple[torch.Tensor, float]:
    """The k tokens a draft trained on ``features`` predicts, and the share of the cached
    completion tokens they cover: the most frequent completion tokens, then the lowest ids (a BPE
    vocabulary lists its common merges first), so tokens rare in the cache still have a chance."""
    if not 0 < k <= vocab_size:
        raise ValueError(f"a draft vocabulary of {k} tokens out of {vocab_size}")
    tokens = torch.tensor([t for _, completion in features.sequences for t in completion], dtype=torch.long)
    counts = torch.bincount(tokens, minlength=vocab_size)
    order = torch.argsort(counts.double() * vocab_size - torch.arange(vocab_size).double(), descending=True)
    chosen = order[:k]
    covered = float(counts[chosen].sum()) / max(1, tokens.numel())
    return chosen, covered


def _policy_key(policy_dir: Path) -> str:
    files = sorted(policy_dir.glob("*.safetensors"))
    sig = [str(policy_dir.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("|".join(sig).encode()).hexdigest()[:10]


TARGET_RECORD = "target.json"  # beside a trained draft: the target it was trained for


def _tokenizer_key(policy_dir: Path) -> str:
    """The tokenizer's files (every file named *tokenizer*), hashed: equal ids mean equal tokens."""
    h = hashlib.sha256()
    for f in sorted(Path(policy_dir).glob("*tokenizer*")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def target_record(policy, policy_dir: Path, taps) -> dict:
    c = policy.config
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "tokenizer": _tokenizer_key(policy_dir), "taps": sorted(int(t) for t in taps)}


def write_target_record(draft_dir: Path, policy, policy_dir: Path, taps) -> None:
    (Path(draft_dir) / TARGET_RECORD).write_text(json.dumps(target_record(policy, policy_dir, taps), indent=2))


def check_target_record(draft_dir: Path, policy, policy_dir: Path, taps) -> None:
    """Refuse a trained draft whose record names another target, tokenizer or tap set (what differs,
    both values). Folders without a record (older saves, other tools) get the structural checks only."""
    path = Path(draft_dir) / TARGET_RECORD
    if not path.is_file():
        return
    found, here = json.loads(path.read_text()), target_record(policy, policy_dir, taps)
    differ = [f"{k} {found.get(k)!r} (draft) != {here[k]!r} (this policy)" for k in here if found.get(k) != here[k]]
    if differ:
        raise ValueError(f"draft {draft_dir} was trained for another target: " + "; ".join(differ))


def shared_layers(target_config) -> list[int]:
    """Every layer some weighted kind taps by default: one feature cache serves all of them."""
    with torch.device("meta"):  # only the configs are needed: allocate nothing
        drafts = [build_draft(k, target_config) for k in available_drafts() if draft_kind(k).has_weights]
    return sorted({l for d in drafts for l in d.feature_layers})


def offline_features(policy, tok, task, *, policy_dir: Path, layers, seed: int, n_prompts: int, max_new_tokens: int,
                     progress: bool = True, on_first_batch=None) -> FeatureCache:
    """The cached target data offline drafts of ``policy`` train from (built on first use; ``on_first_batch``:
    see ``feature_cache.sample_sequences``)."""
    return feature_cache.cached(policy, tok, task, policy_name=str(Path(policy_dir).resolve()),
                                policy_key=_policy_key(Path(policy_dir)), layers=feature_layers(policy, layers),
                                n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed,
                                progress=progress, on_first_batch=on_first_batch)


def feature_layers(policy, layers) -> list[int]:
    """The layers an offline feature cache holds: every kind's default taps, and ``layers``."""
    return sorted(set(layers or ()) | set(shared_layers(policy.config)))


def offline_draft_folder(kind: str, *, task, policy_dir: Path, gamma: int | None, seed: int, recipe: Recipe,
                         layers: list[int] | None = None) -> Path:
    """Where the offline draft of these settings is cached: keyed by the policy (its folder and its weight
    files' sizes and times), the data (a task's name and the knobs that decide its problems; for your data
    files their contents), the kind and its settings (γ, taps), the recipe and the seed."""
    r = recipe
    knobs = hashlib.sha256(json.dumps(task.problem_knobs, sort_keys=True).encode()).hexdigest()[:6]
    vocab = f"-dv{r.draft_vocab}" if r.draft_vocab else ""
    taps = f"-taps{'.'.join(map(str, layers))}" if layers else ""  # chosen taps: another draft, its own entry
    precision = f"-{r.precision}" if r.precision != "float32" else ""  # the setting; report.json has what it chose
    key = (f"{kind}-g{gamma}-{task.name}.{knobs}-s{r.steps}x{r.batch_sequences}-p{r.n_prompts}x{r.max_new_tokens}"
           f"{vocab}{taps}-lr{r.lr:g}{precision}-seed{seed}-{_policy_key(Path(policy_dir))}-v{CACHE_VERSION}")
    return cache_root() / "drafts" / key


def data_label(task) -> str:
    """The prompts an offline draft is trained on, as a user named them: a data file, or a built-in task."""
    files = task.knobs.get("train") if task.name == "data" else None  # your files (codraft.data.FileTask)
    return f"data.train={files}" if files else f"task.name={task.name}"


def offline_draft_dir(kind: str, *, policy, tok, task, policy_dir: Path, gamma: int | None, seed: int,
                      recipe: Recipe | None = None, progress: bool = True, layers: list[int] | None = None,
                      announce: bool = True, skip: str = "draft.init=random") -> Path:
    """A cached draft of ``kind`` trained offline on ``policy`` by ``recipe``; trained on first use.

    layers: EAGLE-3's taps (``draft.taps``); None = the kind's default (and the cache entry without them).
    announce: say on stderr what is reused, or what is built (kind, steps, data, cache, ``skip``: how to go
    without it) before building and then its estimated time (one process of a launch: the trainer's rank 0)."""
    r = recipe or recipe_for(tok, kind)
    folder = offline_draft_folder(kind, task=task, policy_dir=policy_dir, gamma=gamma, seed=seed, recipe=r,
                                  layers=layers)
    if (folder / "report.json").is_file():
        if announce:
            _say(f"reusing the offline {kind} draft of this policy on {data_label(task)} ({folder})")
        return folder / "draft"
    if announce:
        _say(f"the draft starts from offline training, and no offline {kind} draft of this policy on this data is "
             f"cached yet: building one first (once; runs with the same policy, data and draft kind reuse it)\n"
             f"  what: {r.steps} training steps of {r.batch_sequences} sequences, on {r.n_prompts} completions of "
             f"up to {r.max_new_tokens} tokens the policy samples at T=1\n"
             f"  data: the training prompts of {data_label(task)}, rendered as the run renders them\n"
             f"  time: estimated below from the first completions sampled and a timed training step\n"
             f"  cache: {folder}\n"
             f"  skip it: {skip} (an untrained draft), or a trained draft's folder")
    # one process builds (CP/PP ranks, pytest workers); the others wait and then find it built
    with build_lock(folder.with_name(f".{folder.name}.lock"), f"the offline {kind} draft {folder}"):
        if (folder / "report.json").is_file():
            return folder / "draft"
        clock = _BuildClock(kind, r, policy=policy, gamma=gamma, layers=layers, seed=seed, bars=progress) \
            if announce else None
        features = offline_features(policy, tok, task, policy_dir=policy_dir, layers=layers or (),
                                    seed=seed, n_prompts=r.n_prompts, max_new_tokens=r.max_new_tokens,
                                    progress=progress, on_first_batch=clock and clock.after_first_batch)
        if clock is not None and not clock.said:  # the completions were cached: only the training is left
            clock.before_training(features)
        draft, notes = _new_draft(kind, policy, features, gamma=gamma, layers=layers, recipe=r, seed=seed)
        train_offline(policy, tok, task, draft, out_dir=folder, steps=r.steps, batch_sequences=r.batch_sequences,
                      lr=r.lr, seed=seed, progress=progress, features=features, notes=notes, precision=r.precision)
        write_target_record(folder / "draft", policy, policy_dir, draft.feature_layers)
    return folder / "draft"


def _new_draft(kind: str, policy, features: FeatureCache, *, gamma: int | None, layers, recipe: Recipe,
               seed: int) -> tuple[Draft, dict]:
    """(a fresh draft of ``kind`` as ``recipe`` builds it, notes for its report): with a draft vocabulary,
    the ``features``' most frequent completion tokens."""
    options, notes, tokens = ({"layers": list(layers)} if layers else {}), {}, None
    if recipe.draft_vocab:
        tokens, covered = draft_vocabulary(features, policy.config.vocab_size, recipe.draft_vocab)
        notes = {"draft_vocab": recipe.draft_vocab, "draft_vocab_coverage": covered}
        options = {**options, "draft_vocab_size": recipe.draft_vocab}
        if kind not in BLOCK_KINDS:  # chosen at build: exactly these tokens, one count each
            options["token_counts"] = torch.zeros(policy.config.vocab_size).index_fill_(0, tokens, 1.0)
    torch.manual_seed(seed)
    draft = build_draft(kind, policy.config, target=policy, gamma=gamma, **options)
    if tokens is not None and kind in BLOCK_KINDS:
        draft.set_vocabulary(tokens)
    return draft, notes


class _BuildClock:
    """An offline build's time, estimated once from work measured on this machine and said on stderr:
    the first batch of completions (its time per batch, for the batches left), the target over a few of
    them (per token, for the tokens to come) and two training steps of a throwaway draft on those (the
    faster one, per step). When the completions are cached already, the steps are timed on them."""

    def __init__(self, kind: str, recipe: Recipe, *, policy, gamma, layers, seed: int, bars: bool):
        self.kind, self.r, self.policy, self.gamma, self.layers, self.seed = kind, recipe, policy, gamma, layers, seed
        self.bars, self.said = bars, False

    def after_first_batch(self, pairs: list, seconds: float, batches_left: int) -> None:
        few = pairs[:self.r.batch_sequences]
        t0 = time.perf_counter()
        feats, last = feature_cache.target_features(self.policy, few, feature_layers(self.policy, self.layers),
                                                    progress=False)
        per_token = (time.perf_counter() - t0) / sum(len(p) + len(c) for p, c in few)
        step = self._step_seconds(FeatureCache({}, few, feats, last))
        tokens = sum(len(p) + len(c) for p, c in pairs) / len(pairs) * self.r.n_prompts
        sampling, target, training = seconds * batches_left, per_token * tokens, step * self.r.steps
        self._say(sampling + target + training,
                  f"a batch of {len(pairs)} completions sampled in {seconds:.0f} s, so {batches_left} more ~"
                  f"{_duration(sampling)}; the target's features ~{_duration(target)} (a forward over {len(few)} "
                  f"of them); {self.r.steps} steps x {step:.2f} s ~{_duration(training)} (the faster of 2 steps "
                  f"timed on those); on a machine's first run that batch also times its decode paths: this errs long")

    def before_training(self, features: FeatureCache) -> None:
        step = self._step_seconds(features)
        self._say(step * self.r.steps, f"the completions are cached; {self.r.steps} steps x {step:.2f} s "
                                       f"(the faster of 2 steps timed on them)")

    # (the estimate leaves out what is small beside these: optimiser updates, and with a draft vocabulary
    # the teacher's log-sum-exp over the cache, once)

    def _step_seconds(self, features: FeatureCache) -> float:
        """One training step's forward and backward on ``features``, scaled to the recipe's batch."""
        draft, _ = _new_draft(self.kind, self.policy, features, gamma=self.gamma, layers=self.layers, recipe=self.r,
                              seed=self.seed)
        dtype = resolve_precision(self.r.precision, draft)  # ("auto" measures once per machine: before the clock)
        n, dev = min(self.r.batch_sequences, len(features)), self.policy.head_weight.device
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            step_loss(draft, features, self.policy, list(range(n)), draft.feature_layers, dtype,
                      seed=self.seed).backward()
            if dev.type == "cuda":  # (kernels run asynchronously: wait for them)
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return min(times) * min(self.r.batch_sequences, self.r.n_prompts) / n

    def _say(self, seconds: float, basis: str) -> None:
        _say(f"the offline {self.kind} draft needs about {_duration(seconds)} more (estimated on this machine: "
             f"{basis})" + ("; the bars show the time left" if self.bars else ""))
        self.said = True


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _say(text: str) -> None:
    tqdm.write(f"codraft: {text}", file=sys.stderr)  # (above a progress bar in flight, not inside its line)


def starting_draft(kind: str, init: str, *, policy, tok, task, policy_dir: Path, gamma: int | None, seed: int,
                   progress: bool = True, layers: list[int] | None = None, announce: bool = True,
                   skip: str = "draft.init=random", **options) -> Draft:
    """A run's initial draft: ``init`` "random", "offline" (cached short offline training on ``task``'s
    training prompts: the run's own) or a folder.

    Kinds without weights have nothing to train offline: "offline" builds them as they are. layers:
    EAGLE-3's taps (``draft.taps``, None = its default); a folder must have been trained on them.
    announce, skip: see ``offline_draft_dir``."""
    if init == "offline":
        init = offline_draft_dir(kind, policy=policy, tok=tok, task=task, policy_dir=policy_dir, gamma=gamma,
                                 seed=seed, progress=progress, layers=layers, announce=announce, skip=skip) \
            if draft_kind(kind).has_weights else "random"
    draft = init_draft(kind, policy, init=init, gamma=gamma, layers=layers, **options)
    if layers and sorted(draft.feature_layers) != sorted(layers):
        raise ValueError(f"draft.taps={','.join(map(str, layers))} but the draft in {init} was trained on taps "
                         f"{sorted(draft.feature_layers)}: set draft.taps to those (or auto), or start another draft")
    if init != "random" and policy_dir is not None:
        check_target_record(Path(init), policy, Path(policy_dir), draft.feature_layers)
    return draft


def draft_for_command(spec: str, policy, tok, policy_dir, *, gamma: int = 4, init: str = "offline", seed: int = 0,
                      progress: bool = True) -> Draft:
    """The draft `codraft generate` / `codraft bench spec` ask for: a kind (``init`` "offline": cached
    short offline training on the policy's default task; "random": untrained) or a saved folder."""
    if spec in available_drafts():
        task = make_task(default_task_name(tok)) if init == "offline" else None
        return starting_draft(spec, init, policy=policy, tok=tok, task=task, policy_dir=Path(policy_dir),
                              gamma=gamma, seed=seed, progress=progress, skip="--draft-init random")
    if not Path(spec).is_dir():
        raise ValueError(f"unknown draft {spec!r}: not a draft folder, and not a kind "
                         f"(valid kinds: {', '.join(available_drafts())})")
    draft = load_draft(spec, policy, gamma=gamma)
    check_target_record(Path(spec), policy, Path(policy_dir), draft.feature_layers)
    return draft
