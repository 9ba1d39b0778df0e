"""The tiny warm start: noisy demonstrations (wrong final answers at the configured rate, chain kept),
its lr schedule, and the cached folder it writes."""
from __future__ import annotations

import json
import math
import random

import pytest

from codraft.tasks import make_task
from codraft.train.schedule import warmup_cosine
from codraft.policy.warmstart import SFTConfig, load_tiny, sft_targets, warm_start, wrong_answer


def _problems(n, **knobs):
    return make_task("arith", **knobs).sample("train", n, seed=3)


@pytest.mark.parametrize("knobs", [{}, {"operands": (3, 5), "add_digits": (2, 3), "max_value": None}])
def test_wrong_answer_keeps_the_chain_and_scores_zero(knobs):
    task = make_task("arith", **knobs)
    rng = random.Random(0)
    for p in _problems(200, **knobs):
        text = wrong_answer(task, p, rng)
        chain, answer = text.rsplit("#", 1)
        assert chain == p.solution.rsplit("#", 1)[0]
        assert answer.isdigit() and int(answer) != int(p.answer)
        assert task.reward(p, text) == 0.0
        assert task.reward(p, p.solution) == 1.0


def test_sft_targets_noise_rate():
    task = make_task("arith")
    problems = _problems(500)
    for rate in (0.0, 0.3):
        texts = sft_targets(task, problems * 4, rate, random.Random(1))
        wrong = sum(task.reward(p, t) == 0.0 for p, t in zip(problems * 4, texts)) / len(texts)
        # 2000 draws: binomial sd ~0.01; 0.0 must give exactly the clean targets
        assert (wrong == 0.0) if rate == 0.0 else abs(wrong - rate) < 0.04, (rate, wrong)
    clean = sft_targets(task, problems, 0.0, random.Random(1))
    assert clean == [task.format_completion(p) for p in problems]


@pytest.mark.parametrize("bad", [{"answer_noise": 1.0}, {"answer_noise": -0.1}, {"min_lr_ratio": 1.5}])
def test_sft_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SFTConfig(**bad)


def test_lr_factor_warms_up_then_decays_to_the_floor():
    cfg = SFTConfig(steps=100, warmup=10, min_lr_ratio=0.1)
    f = warmup_cosine(cfg.warmup, cfg.steps, cfg.min_lr_ratio)
    assert f(0) == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0.0))))
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 100)))
    assert f(50) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(100) == pytest.approx(0.1) and f(150) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(9, 120))


def test_warm_start_writes_a_loadable_cached_folder(tmp_path):
    cfg = SFTConfig(steps=2, batch_size=4, warmup=1, val_size=3, max_new_tokens=8)
    folder = warm_start(cfg, cache_dir=tmp_path / "sft", progress=False)
    report = json.loads((folder / "sft.json").read_text())
    assert report["parameters"] > 0 and 0.0 <= report["val_accuracy"] <= 1.0
    assert report["config"]["answer_noise"] == cfg.answer_noise and report["config"]["steps"] == 2
    model, tok = load_tiny(folder)
    assert tok.vocab_size == model.config.vocab_size
    stamp = (folder / "sft.json").stat().st_mtime_ns
    assert warm_start(cfg, cache_dir=folder, progress=False) == folder  # cached: not retrained
    assert (folder / "sft.json").stat().st_mtime_ns == stamp


def test_sft_loss_on_the_padded_view_equals_the_packed_forward():
    """The SFT batch comes from the one packer; its padded view gives the same loss as running the
    packed row (varlen attention, one sequence at a time), and the same sequences."""
    import torch
    import torch.nn.functional as F

    from codraft.models import Transformer
    from codraft.policy.warmstart import _batch, sft_loss, tiny_model_config
    from codraft.tokenizer import CharTokenizer
    tok, task = CharTokenizer(), make_task("arith")
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(tok)).double()
    problems = _problems(6)
    texts = sft_targets(task, problems, 0.5, random.Random(2))
    batch = _batch(tok, problems, texts, "cpu")
    ids, completion = batch.padded(tok.pad_id)
    for i, (p, t) in enumerate(zip(problems, texts)):
        row = tok.prompt_ids(p.prompt) + tok.encode(t) + [tok.eos_id]
        assert ids[i, :len(row)].tolist() == row and (ids[i, len(row):] == tok.pad_id).all()
        assert completion[i].sum() == len(tok.encode(t)) + 1
    targets = batch.index[batch.index_mask]
    hidden = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, head=False)
    packed = F.cross_entropy(model.logits(hidden[0, targets - 1]), batch.input_ids[0, targets])
    torch.testing.assert_close(sft_loss(model, batch, tok.pad_id), packed, rtol=1e-10, atol=1e-12)
