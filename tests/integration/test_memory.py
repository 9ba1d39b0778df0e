"""Will the run fit (``codraft.rl.memory``): the step's memory estimated before anything loads, against the
memory measured in real steps and against the machine (a run that cannot fit is refused in seconds, creating
nothing); an allocation that fails anyway (one line, no folder left to block a rerun); task prompts longer
than the policy's context. Run as a script, this file is the measuring side (``_measure``)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codraft.config import load_config
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, read_tiny, tiny_model_config
from codraft.rl import memory
from codraft.train.run_dir import check_fresh

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LINUX = os.path.isfile("/proc/meminfo") and os.path.isfile("/proc/self/clear_refs")


def _codraft(*args, address_space: int | None = None) -> subprocess.CompletedProcess:
    def limit():  # a real allocator failure at that size, without touching the machine's memory
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    return subprocess.run([sys.executable, "-m", "codraft", *args], env=ENV, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit if address_space else None)


def short_context_policy(path: Path, context: int = 64) -> Path:
    """A random HF-format Llama folder with a byte-level tokenizer (no chat template) and a context of
    ``context`` positions: prompts that overflow it stay cheap."""
    from tokenizer_folder import tiny_tokenizer_folder
    from codraft.models import ModelConfig, Transformer, save_pretrained
    torch.manual_seed(0)
    save_pretrained(Transformer(ModelConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=context, eos_token_id=2)), path)
    return tiny_tokenizer_folder(path, template=None)


# ---------------------------------------------------------------- refused before anything is created


@pytest.mark.skipif(not LINUX, reason="MemAvailable is read from /proc/meminfo")
def test_a_step_larger_than_the_memory_is_refused_in_seconds_creating_nothing(tmp_path):
    """The issue's run: its KV cache alone is hundreds of GiB; refused from the config and tiny-sft's shapes
    (no warm start, no weights), before the run folder (or its lock) exists."""
    run = tmp_path / "runs" / "big"
    t0 = time.monotonic()
    done = _codraft("train", "rollout.group_size=100000", f"run_dir={run}")
    seconds = time.monotonic() - t0
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert re.fullmatch(r"codraft train: error: the run needs ~[\d.]+ GiB at its step's peak \(weights [\d.]+ \+ "
                        r"max\(rollout [\d.]+, update [\d.]+\) \+ host [\d.]+ GiB\) but this machine has [\d.]+ GiB "
                        r"available; lower rollout.group_size=100000, rollout.prompts_per_step=8 or "
                        r"rollout.max_new_tokens=64, or raise parallel.microbatches=1; or set memory_check=false "
                        r"\(the estimate takes every completion at rollout.max_new_tokens\)", lines[0]), lines[0]
    assert not (tmp_path / "runs").exists()
    assert seconds < 60, f"refused after {seconds:.0f} s"


@pytest.mark.skipif(not LINUX, reason="RLIMIT_AS and the allocator's error text are Linux's")
def test_an_allocation_that_fails_in_the_first_step_is_one_line_and_leaves_no_folder(tmp_path, tiny_policy_dir):
    """memory_check=false lets a too-large step start; an address-space limit makes its KV cache allocation
    fail for real. The error names the keys, and the folders the run created are gone: a rerun may use it."""
    run = tmp_path / "runs" / "oom"
    done = _codraft("train", f"policy.init={tiny_policy_dir}", f"run_dir={run}", "rollout.group_size=1000",
                    "rollout.max_new_tokens=4000", "memory_check=false", "draft.mode=none", "log.val_every=0",
                    "steps=1", address_space=3 << 30)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"codraft train: error: step 0: out of memory \(DefaultCPUAllocator: can't allocate memory: "
                        r"you tried to allocate \d+ bytes.*\); lower rollout.group_size=1000, "
                        r"rollout.prompts_per_step=8 or rollout.max_new_tokens=4000, or raise "
                        rf"parallel.microbatches=1; {re.escape(str(run))} was removed \(no step had completed\): "
                        r"rerun with the same run_dir=", last), last
    assert not (tmp_path / "runs").exists()
    check_fresh(run)


def test_task_prompts_longer_than_the_context_are_refused_before_the_run(tmp_path):
    from codraft.rl.trainer import Trainer
    policy = short_context_policy(tmp_path / "policy")
    cfg = load_config(None, [f"policy.init={policy}", f"run_dir={tmp_path / 'run'}", "rollout.max_new_tokens=60",
                             "draft.mode=none"])
    with pytest.raises(memory.ContextError, match=r"^task 'arith': its longest prompt has (\d+) tokens \+ "
                                                  r"rollout.max_new_tokens=60 = \d+ > the model's context of 64 "
                                                  r"positions \(max_position_embeddings\); lower "
                                                  r"rollout.max_new_tokens"):
        Trainer(cfg, progress=False)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the estimate


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "none"])
def test_the_estimate_grows_linearly_in_group_size(kind):
    """Every part but the weights is per row (per completion in the update): doubling the rows doubles them."""
    m, _ = read_tiny()

    def est(g):
        cfg = load_config(None, [f"rollout.group_size={g}", "log.val_every=0",
                                 *(["draft.mode=none"] if kind == "none" else [f"draft.kind={kind}"])])
        return memory.estimate(cfg, m, prompt_len=20)
    base = est(64)
    for k in (2, 3, 4):
        e = est(64 * k)
        assert e.weights == base.weights
        for part in ("rollout", "train", "host"):
            grown, one = getattr(e, part), getattr(base, part)
            assert grown == pytest.approx(k * one, rel=0.02), (part, k)  # (the prefill of the 8 prompts is not)
    assert est(100000).peak > 100 * 2**30  # the run: far beyond any machine


@pytest.mark.skipif(not LINUX, reason="peak RSS through /proc/self/status and clear_refs")
@pytest.mark.parametrize("overrides", [["draft.kind=dflash", "grpo.kl_coef=0.01"], ["draft.mode=none"]],
                         ids=["dflash-kl", "no-draft"])
def test_the_estimate_is_within_2x_of_a_measured_step(tmp_path, overrides):
    """A real step of the tiny preset's shapes (random weights: completions run to max_new_tokens): the peak
    RSS growth of its rollout and of its update (gradients included), measured in a fresh process with
    glibc returning every freed block above 64 KiB, against the estimate's parts."""
    env = {**ENV, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, str(tmp_path), "rollout.group_size=32",
                           "rollout.prompts_per_step=2", "rollout.max_new_tokens=16", *overrides],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rollout_bytes"] > 4 * 2**20 and got["update_bytes"] > 40 * 2**20  # above the noise
    for part, est in (("rollout", got["estimate_rollout"]), ("update", got["estimate_update"])):
        ratio = est / got[f"{part}_bytes"]
        assert 0.5 <= ratio <= 2.0, (part, ratio, got)


def _measure(folder: str, overrides: list[str]) -> dict:
    """Step 0 (Adam's moments allocated), then step 1's rollout and update, each from a reset peak RSS."""
    from codraft.models import Transformer, save_pretrained
    from codraft.rl.trainer import Trainer
    from codraft.tokenizer import CharTokenizer
    torch.set_num_threads(1)

    def rss(key="VmRSS"):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

    def reset():  # VmHWM := VmRSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    tok = CharTokenizer()
    torch.manual_seed(0)
    save_pretrained(Transformer(tiny_model_config(tok)), f"{folder}/policy",
                    extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    cfg = load_config(None, [f"policy.init={folder}/policy", f"run_dir={folder}/run", "log.val_every=0",
                             "log.speedup_every=0", "log.checkpoint_every=0", "draft.init=random", *overrides])
    t = Trainer(cfg, progress=False)
    t.step(0)
    torch.manual_seed(1)
    reset()
    before = rss()
    rollout = t.rollout(1)
    rollout_bytes = rss("VmHWM") - before
    scored = t.score(1, rollout)
    reset()
    before = rss()
    t.update(1, rollout, scored)
    update_bytes = rss("VmHWM") - before
    est = memory.estimate(cfg, t.policy.config, max(map(len, rollout.prompts)))
    grads = 4 * sum(p.numel() for p in t.policy.parameters()) + \
        (4 * sum(p.numel() for p in t.draft.trainable_parameters()) if t.trains_draft else 0)
    return {"rollout_bytes": rollout_bytes, "update_bytes": update_bytes, "estimate_rollout": est.rollout,
            "estimate_update": est.train + grads,  # the update allocates the gradients (the estimate's weights)
            "completion_len": sum(len(o.tokens) for o in rollout.out) / len(rollout.out)}


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1], sys.argv[2:])))
