"""`codraft generate`: JSON structure, lossless greedy speculation through the CLI, draft folders, errors."""
import json

import pytest
import torch

from codraft.cli import main
from codraft.models import Transformer, save_pretrained
from codraft.tokenizer import CharTokenizer
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config

PROMPTS = ["12+3=", "7*8-1=", "99-9*2="]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim = 32, 64, 2, 8
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # larger than the default init: varied greedy text, partly predictable by ngram
        for w in model.parameters():
            if w.dim() == 2:
                w.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp("gen") / "policy"
    save_pretrained(model, folder, extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    return folder


def _generate(capsys, *args):
    main(["generate", *map(str, args)])
    return capsys.readouterr().out


def _json(capsys, policy_dir, *args):
    return json.loads(_generate(capsys, "--model", policy_dir, "--json", "--temperature", 0, "--max-new-tokens", 20,
                                "--prompt", *PROMPTS, *args))


def test_greedy_spec_equals_plain_and_json_structure(capsys, policy_dir):
    plain = _json(capsys, policy_dir)
    spec = _json(capsys, policy_dir, "--draft", "ngram", "--gamma", 3)
    tok = CharTokenizer()
    assert plain["draft"] is None and spec["draft"] == "ngram" and spec["gamma"] == 3
    assert len(plain["results"]) == len(spec["results"]) == len(PROMPTS)
    for p, r, s in zip(PROMPTS, plain["results"], spec["results"]):
        assert set(r) == {"prompt", "prompt_tokens", "tokens", "text", "logprobs", "finish_reason"}
        assert r["prompt"] == p and r["prompt_tokens"] == tok.prompt_ids(p)
        assert s["tokens"] == r["tokens"]  # lossless: greedy speculation is token-for-token plain greedy
        assert 1 <= len(r["tokens"]) <= 20 and len(r["logprobs"]) == len(r["tokens"])
        assert r["text"] == tok.decode(r["tokens"])
        assert r["finish_reason"] == ("eos" if r["tokens"][-1] == tok.eos_id else "length")
        assert s["logprobs"] == pytest.approx(r["logprobs"], abs=1e-4)
    assert plain["stats"]["acceptance_length"] == 1.0 and plain["stats"]["acceptance_per_position"] == []
    st = spec["stats"]
    assert len(st["acceptance_per_position"]) == 3
    assert 1.0 < st["acceptance_length"] < 4.0  # some drafts rejected, some accepted: the rule was exercised
    assert st["acceptance_length"] == pytest.approx(1 + sum(st["acceptance_per_position"]))
    assert st["emitted_tokens"] == sum(len(r["tokens"]) for r in spec["results"])
    for key in ("tokens_per_s", "prefill_s", "draft_s", "verify_s", "bookkeeping_s", "wall_s"):
        assert st[key] >= 0


def test_saved_draft_folder_is_detected(capsys, policy_dir):
    """A model folder given as --draft is loaded as a "model" draft; the policy drafting for itself
    has every greedy proposal accepted."""
    spec = _json(capsys, policy_dir, "--draft", policy_dir, "--gamma", 2)
    assert spec["stats"]["acceptance_per_position"] == pytest.approx([1.0, 1.0])
    assert spec["results"][0]["tokens"] == _json(capsys, policy_dir)["results"][0]["tokens"]


def test_text_output_has_stats_line(capsys, policy_dir):
    out = _generate(capsys, "--model", policy_dir, "--draft", "ngram", "--prompt", "1+1=", "--max-new-tokens", 8)
    assert "--- [0] '1+1='" in out and "tok/s" in out and "τ=" in out and "per-position acceptance" in out


@pytest.mark.parametrize("args, message", [
    (["--draft", "bogus"], "unknown draft 'bogus'.*valid kinds: eagle3, dflash, dspark, model, ngram"),
    (["--gamma", "3"], "--gamma 3 needs a --draft"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an int >= 1"),
])
def test_errors_are_one_line(policy_dir, args, message):
    with pytest.raises(SystemExit, match=f"codraft generate: error: {message}"):
        main(["generate", "--model", str(policy_dir), *args])


def test_bad_model_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="codraft generate: error: policy .*nope.* neither a known name"):
        main(["generate", "--model", str(tmp_path / "nope")])
