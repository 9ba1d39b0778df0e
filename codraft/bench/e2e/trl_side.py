"""TRL's side of `codraft bench e2e`: ``GRPOTrainer`` on the same model, prompts and batch.

``trl`` is TRL's ``GRPOTrainer`` (optional dependency ``trl``): the HF model loaded with
``AutoModelForCausalLM.from_pretrained`` in fp32, a ``datasets.Dataset`` of chat prompts,
``num_generations=group``, per-device batch ``prompts·group``, ``max_completion_length``,
``beta=0``, no vLLM (``transformers.generate``), ``loss_type="dapo"``, gradient checkpointing
off (codraft does not recompute either), bf16 off, the task's own reward function, no
logging, no saving, a temp output dir.

Timing: step = ``on_step_begin`` → ``on_step_end`` (generation, scoring, loss forward,
backward, clipping, optimiser); rollout = ``_generate_and_score_completions`` (HF
``generate`` + decoding + reward + advantages; ``generate`` alone is reported too); train =
step − rollout, split into the loss forward (``compute_loss``), the optimiser (TRL's
``on_pre_optimizer_step`` / ``on_optimizer_step`` callbacks) and bwd+clip (the rest).

``trainer.train()`` runs in a worker thread that a callback holds at every ``on_step_begin``
until the main thread lets it take its step (nothing else runs meanwhile). torch intra-op
threads are set inside that thread too: OpenMP's thread count is per OS thread.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch

from codraft.bench import CpuMeter


def trl_missing_reason() -> str | None:
    """Why the TRL side cannot run here, or None."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        return f"`trl` is not importable ({e}); install it with `pip install trl torch==$(python -c " \
               f"'import torch; print(torch.__version__.split(\"+\")[0])')` (keeps the installed torch)"
    return None


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


def _grpo_config(*, prompts, group, max_new_tokens, lr, seed, total_steps, out_dir, gradient_checkpointing):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
        num_generations=group, max_completion_length=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, max_steps=total_steps, shuffle_dataset=False,
        use_vllm=False, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=gradient_checkpointing,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        log_completions=False, seed=seed, data_seed=seed, dataloader_num_workers=0,
    )


def _gate(side: "TrlSide"):
    """The callback that parks TRL's training thread at each step and records the step's timings."""
    from transformers import TrainerCallback

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
    return Gate()


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
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOTrainer

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
        args = _grpo_config(prompts=prompts, group=group, max_new_tokens=max_new_tokens, lr=lr, seed=seed,
                            total_steps=total_steps, out_dir=out_dir, gradient_checkpointing=gradient_checkpointing)
        self.trainer = GRPOTrainer(model=model, reward_funcs=[self._reward_fn(problems, task)], args=args,
                                   train_dataset=datasets.Dataset.from_list(rows), processing_class=self.tokenizer,
                                   callbacks=[_gate(self)])
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

    def _reward_fn(self, problems: list, task):
        def task_reward(prompts, completions, idx, completion_ids=None, **_):
            """codraft's own task reward for each completion (idx: the problem's row in ``problems``)."""
            self.seen_idx.append(list(idx))
            if completion_ids is not None:
                self._lens += [len(c) for c in completion_ids]
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            r = [float(task.reward(problems[i], t)) for i, t in zip(idx, texts)]
            self._rewards += r
            return r
        return task_reward

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
            "others_cores": load.get("others_cores"), "stolen_cores": load.get("stolen_cores"),
            "torch_threads": torch.get_num_threads()})

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
