"""`codraft generate`: JSON structure, lossless greedy speculation through the CLI, draft folders, errors;
bad values of `codraft generate` / `codraft train-draft` / ``Engine.generate`` refused before any work."""
import json
import math
import random
import subprocess
import sys

import pytest
import torch

import codraft.policy
import codraft.train.feature_cache
from codraft.cli import main
from codraft.drafts import build_draft
from codraft.models import Transformer, load_pretrained, save_pretrained
from codraft.rollout import Engine
from codraft.train.offline_draft import train_offline
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
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
])
def test_errors_are_one_line(policy_dir, args, message):
    with pytest.raises(SystemExit, match=f"codraft generate: error: {message}"):
        main(["generate", "--model", str(policy_dir), *args])


def test_bad_model_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="codraft generate: error: policy .*nope.* neither a known name"):
        main(["generate", "--model", str(tmp_path / "nope")])


@pytest.mark.parametrize("kind, cut", [("eagle3", False), ("dspark", True), ("model", True)])
def test_corrupt_draft_weights_are_one_line(tmp_path, policy_dir, kind, cut):
    """A draft folder whose model.safetensors is random bytes or cut short (each kind reads it its own
    way; "model" is an HF folder): the command prints one line naming the file, no traceback."""
    build_draft(kind, load_pretrained(policy_dir).config).save(tmp_path / "d")
    f = tmp_path / "d" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2] if cut else random.Random(0).randbytes(300))
    done = subprocess.run([sys.executable, "-m", "codraft", "generate", "--model", str(policy_dir), "--draft",
                           str(tmp_path / "d"), "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"codraft generate: error: {f} cannot be loaded: not a valid safetensors file, "
                                  "truncated or corrupt (") and done.stderr.count("\n") == 1, done.stderr


# ---------------------------------------------------------------- bad values: refused before any work


def _no_loading(monkeypatch):
    def called(*a, **k):
        raise AssertionError("the policy was loaded before the arguments were checked")
    monkeypatch.setattr(codraft.policy, "load_policy", called)


@pytest.mark.parametrize("args, message", [
    (["--draft", "ngram", "--gamma", "0"], r"--gamma must be >= 1 \(tokens drafted per round\), got 0"),
    (["--gamma", "0"], "--gamma must be >= 1"),
    (["--prompt", ""], "--prompt: prompt 1 is empty"),
    (["--prompt", "1+1=", ""], "--prompt: prompt 2 is empty"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
    (["--temperature", "nan"], r"--temperature must be >= 0 and finite \(0 = greedy\), got nan"),
    (["--temperature", "-1"], "--temperature must be >= 0 and finite"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\] \(1 = off\), got 0.0"),
    (["--top-p", "inf"], r"--top-p must be in \(0, 1\]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_generate_refuses_bad_values_before_loading(monkeypatch, args, message):
    _no_loading(monkeypatch)
    with pytest.raises(SystemExit, match=f"^codraft generate: error: {message}"):
        main(["generate", "--model", "tiny-sft", *args])


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=math.nan), r"temperature must be >= 0 and finite \(0 = greedy\), got nan"),
    (dict(temperature=math.inf), "temperature must be >= 0 and finite"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\] \(1 = off\), got nan"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=1.5), "top_k must be >= 0"),
    (dict(seed=1.5), "seed must be an int or None"),
])
def test_engine_refuses_bad_sampling_settings(policy_dir, kw, message):
    engine = Engine(load_pretrained(policy_dir))
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2]], 4, **kw)
    assert engine.generate([[1, 2]], 2, temperature=0.0, top_p=1.0, top_k=0, seed=0)[0].tokens  # still usable


@pytest.mark.parametrize("args, message", [
    (["--kind", "ngram"], "--kind ngram has no weights: nothing to train; kinds with weights: eagle3, dflash, dspark, "
                          "model$"),
    (["--kind", "medusa"], "--kind 'medusa' is not a draft kind; kinds with weights to train: eagle3, dflash"),
    (["--kind", "dflash", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--kind", "dflash", "--prompts", "0"], "--prompts must be >= 1"),
    (["--kind", "dflash", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--kind", "dflash", "--gamma", "0"], "--gamma must be >= 1"),
    (["--kind", "dflash", "--lr", "nan"], "--lr must be > 0 and finite, got nan"),
    (["--kind", "dflash", "--task", "chess"], "--task must be one of arith, arith_haystack, chain_sum, gsm_symbolic, lookup, got 'chess'"),
    (["--kind", "dflash", "--taps", "0,1,2"], r"--taps must be auto with --kind dflash \(it sets the EAGLE-3 draft"),
    (["--kind", "eagle3", "--taps", "0,1"], "--taps must name 3 layers with --kind eagle3"),
    (["--kind", "eagle3", "--taps", "1,1,2"], "--taps must be auto or distinct layer ids >= 0"),
])
def test_train_draft_refuses_bad_values_before_loading(tmp_path, monkeypatch, args, message):
    _no_loading(monkeypatch)
    out = tmp_path / "drafts" / "d"
    with pytest.raises(SystemExit, match=f"^codraft train-draft: error: {message}"):
        main(["train-draft", "--model", "tiny-sft", "--out", str(out), *args])
    assert not (tmp_path / "drafts").exists()


def test_train_draft_taps(tmp_path, policy_dir, monkeypatch):
    """--taps: the EAGLE-3 draft is trained on those layers (saved and recorded with them); taps outside
    the policy's servable layers are refused once its depth is known, before anything is written."""
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)  # the tiny preset's 4 layers: default taps [0, 1], two
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 32, 64, 8
    torch.manual_seed(0)
    save_pretrained(Transformer(cfg), tmp_path / "policy4",
                    extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    small = ["--steps", "1", "--prompts", "2", "--max-new-tokens", "4"]
    main(["train-draft", "--model", str(tmp_path / "policy4"), "--kind", "eagle3", "--taps", "2,0,1",
          "--out", str(tmp_path / "d"), *small])
    saved = json.loads((tmp_path / "d" / "draft" / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert json.loads((tmp_path / "d" / "draft" / "target.json").read_text())["taps"] == [0, 1, 2]
    with pytest.raises(SystemExit, match=r"^codraft train-draft: error: --taps must be layer ids in \[0, 0\] "
                                         r"for the 2-layer policy"):
        main(["train-draft", "--model", str(policy_dir), "--kind", "eagle3", "--taps", "0,1,2",
              "--out", str(tmp_path / "e"), *small])
    assert not (tmp_path / "e").exists()


def test_train_draft_failure_leaves_no_empty_folder(tmp_path, policy_dir, monkeypatch):
    """A failure after the output folder was made (here: while sampling the data) removes the folders
    the command created while they are still empty; a folder that was there already stays."""
    def fail(*a, **k):
        raise RuntimeError("sampling failed")
    monkeypatch.setattr(codraft.train.feature_cache, "sample_sequences", fail)
    out = tmp_path / "new" / "d"
    with pytest.raises(RuntimeError, match="sampling failed"):
        main(["train-draft", "--model", str(policy_dir), "--kind", "dflash", "--out", str(out), "--steps", "2"])
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError, match="sampling failed"):
        main(["train-draft", "--model", str(policy_dir), "--kind", "dflash", "--out", str(tmp_path / "kept" / "d")])
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "d").exists()


@pytest.mark.parametrize("kw, message", [
    (dict(steps=0), "steps must be an int >= 1, got 0"),
    (dict(n_prompts=0), "n_prompts must be an int >= 1"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 1"),
    (dict(batch_sequences=0), "batch_sequences must be an int >= 1"),
    (dict(checkpoint_every=0), "checkpoint_every must be an int >= 1"),
    (dict(lr=math.nan), "lr must be > 0 and finite, got nan"),
])
def test_train_offline_checks_arguments_before_making_the_folder(tmp_path, kw, message):
    with pytest.raises(ValueError, match=f"^train_offline: {message}"):
        train_offline(None, None, None, None, out_dir=tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- prompts against the model's context


def test_a_prompt_longer_than_the_context_is_one_line_before_any_prefill(tmp_path):
    """tiny-sft declares TINY_MAX_POSITIONS once loaded (long arith_haystack prompts fit): a prompt past it is
    refused naming both lengths, from the model's config (no warm start, no weights, no prefill)."""
    import subprocess
    import sys
    from codraft.policy.warmstart import TINY_MAX_POSITIONS
    text = "1+2=" * (TINY_MAX_POSITIONS // 4 + 16)  # + BOS: 65601 tokens
    done = subprocess.run([sys.executable, "-m", "codraft", "generate", "--model", "tiny-sft", "--prompt", text,
                           "--max-new-tokens", "64"], capture_output=True, text=True, timeout=300)
    n = len(text) + 1
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"codraft generate: error: --prompt 1 has {n} tokens + --max-new-tokens=64 = {n + 64} > the model's context "
        f"of {TINY_MAX_POSITIONS} positions (max_position_embeddings); shorten it, lower --max-new-tokens, or pass "
        f"--truncate-prompt left to keep its last {TINY_MAX_POSITIONS - 64} tokens"]


def test_truncate_prompt_left_keeps_the_prompts_last_tokens(tmp_path, capsys):
    """A 64-position model: a 100-byte prompt with 8 new tokens is refused, and with --truncate-prompt left it
    runs on its last 56 tokens (the JSON shows them and the length it was cut from); a prompt that fits is
    untouched. --max-new-tokens filling the context leaves no room at all."""
    from test_memory import short_context_policy
    from codraft.tokenizer import load_tokenizer
    folder = short_context_policy(tmp_path / "m", context=64)
    long, short = "0123456789" * 10, "1+1="
    args = ["generate", "--model", str(folder), "--prompt", long, short, "--max-new-tokens", "8", "--temperature", "0"]
    with pytest.raises(SystemExit, match=r"^codraft generate: error: --prompt 1 has 100 tokens \+ --max-new-tokens=8 = "
                                         r"108 > the model's context of 64 positions"):
        main(args)
    main([*args, "--truncate-prompt", "left", "--json"])
    out = capsys.readouterr()
    got = json.loads(out.out)["results"]
    ids = load_tokenizer(folder).prompt_ids(long)
    assert got[0]["prompt_tokens"] == ids[-56:] and got[0]["prompt_truncated_from"] == 100
    assert got[1]["prompt_tokens"] == load_tokenizer(folder).prompt_ids(short) and "prompt_truncated_from" not in got[1]
    assert 1 <= len(got[0]["tokens"]) <= 8
    assert "prompt 1 cut from 100 to its last 56 tokens (context 64 - --max-new-tokens 8)" in out.err
    with pytest.raises(SystemExit, match="--max-new-tokens 64 leaves no room for a prompt in the model's context"):
        main(["generate", "--model", str(folder), "--prompt", short, "--max-new-tokens", "64", "--truncate-prompt",
              "left"])
