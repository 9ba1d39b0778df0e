"""Checks that need an accelerator, in one short run: the code paths CI (CPU only) never takes.

Usage: PYTHONPATH=. python scripts/device_check.py [--device cuda] [--out FILE.json] [--checks engine,...]
Needs torch, transformers-free codraft (no packaged model or dataset: random weights only).

1. engine: greedy speculative decoding equals plain decoding on the device, every draft kind,
   fp32 and the bf16 rollout copy (``codraft.rollout.weights``: bf16 throughout off-CPU);
2. lossless sampling on the device: an n-gram draft's samples against the exact enumerated
   distribution (the oracle of tests/spec_harness.py), fp32 and bf16 targets;
3. training: the co-training loss and every policy gradient on the device against the CPU;
4. the trainer: a few GRPO steps with device=<device>, rollout.dtype=bfloat16, each draft kind;
5. timing: plain decoding of a SmolLM2-135M-shaped model (random weights), fp32 vs the bf16
   copy, batch 1 and 8 (the accelerator's figures; the CPU's are `codraft bench spec`).
Prints one line per check and a JSON summary; exits 1 if a check fails.
"""
import argparse
import copy
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from codraft.config import load_config  # noqa: E402
from codraft.drafts import build_draft, init_draft  # noqa: E402
from codraft.models import ModelConfig, Transformer, save_pretrained  # noqa: E402
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config  # noqa: E402
from codraft.rl.cotrain import cotrain_loss  # noqa: E402
from codraft.rl.trainer import Trainer  # noqa: E402
from codraft.rollout import Engine  # noqa: E402
from codraft.rollout.weights import RolloutWeights  # noqa: E402
from codraft.tokenizer import CharTokenizer  # noqa: E402
from codraft.train.packing import pack  # noqa: E402

KINDS = ("eagle3", "dflash", "dspark", "model", "ngram")


def tiny_policy(seed=0) -> tuple[Transformer, CharTokenizer]:
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim = 64, 128, 4, 64 // cfg.num_attention_heads
    torch.manual_seed(seed)
    return Transformer(cfg).eval(), tok


def check_engine(dev):
    policy, tok = tiny_policy()
    policy.to(dev)
    prompts = [tok.prompt_ids(s) for s in ["12+3=", "7*8-1=", "5+5=", "99-9*2="]]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = RolloutWeights(policy, dtype).policy
        plain = [r.tokens for r in Engine(target).generate(prompts, 24, temperature=0.0, eos_id=[])]
        for kind in KINDS:
            torch.manual_seed(1)
            draft = init_draft(kind, policy, gamma=3) if kind != "ngram" else build_draft("ngram", policy.config, n=2)
            engine = Engine(target, draft, 3)
            spec = [r.tokens for r in engine.generate(prompts, 24, temperature=0.0, eos_id=[])]
            engine.generate(prompts, 24, temperature=1.0, seed=3, eos_id=[])  # sampling runs too
            assert spec == plain, f"{kind} {dtype}: greedy speculative tokens differ from plain"
            out[f"{kind}/{dtype}"] = engine.stats.acceptance_length
    return out


def check_lossless(dev):
    import spec_harness as h
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        cpu = h.scaled(Transformer(h.config(1)), 0.8, seed=0)
        target = RolloutWeights(cpu.to(dev), dtype).policy
        exact = h.exact_joint(target, 3)  # enumerated on the device model itself
        engine = Engine(target, build_draft("ngram", target.config, n=2), gamma=2)
        res = engine.generate([h.PROMPT] * 20000, 3, temperature=1.0, seed=7, eos_id=[])
        ok, stat, crit = h.chi2_fits(h.histogram(res, 3), exact.cpu(), alpha=1e-3)
        assert ok and engine.stats.accepted > 0, f"{dtype}: chi2 {stat:.1f} >= {crit:.1f}"
        out[str(dtype)] = {"chi2": stat, "critical": crit, "accepted": engine.stats.accepted}
    return out


def check_training(dev):
    policy, tok = tiny_policy()
    prompts = [tok.prompt_ids(s) for s in ["12+3=", "7*8-1=", "5+5=", "99-9*2="]]
    res = Engine(policy).generate(prompts, 16, temperature=1.0, seed=0, eos_id=tok.eos_id)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads, losses = {}, {}
    for where in ("cpu", dev):
        p = copy.deepcopy(policy).to(where).train()
        batch = pack(prompts, [r.tokens for r in res], [r.logprobs for r in res], device=where)
        loss, _ = cotrain_loss(p, None, batch, adv.to(where), temperature=1.0, lam=0.0, eps_low=0.2, eps_high=0.28,
                               norm="token", tis_cap=2.0)
        loss.backward()
        losses[where] = float(loss)
        grads[where] = {n: q.grad.detach().cpu() for n, q in p.named_parameters()}
    worst = max(float((grads[dev][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in grads["cpu"].items())
    assert abs(losses[dev] - losses["cpu"]) < 1e-4 * max(1.0, abs(losses["cpu"])) and worst < 1e-3, (losses, worst)
    for kind in ("eagle3", "dflash", "dspark"):  # the draft loss runs and trains on the device
        p = copy.deepcopy(policy).to(dev)
        draft = init_draft(kind, p, gamma=3)
        batch = pack(prompts, [r.tokens for r in res], [r.logprobs for r in res], device=dev)
        loss, m = cotrain_loss(p, draft, batch, adv.to(dev), temperature=1.0, lam=1.0, eps_low=0.2, eps_high=0.28,
                               norm="token")
        loss.backward()
        assert torch.isfinite(loss) and all(q.grad is not None for q in draft.trainable_parameters()), kind
    return {"loss": losses, "worst_relative_grad_error": worst}


def check_trainer(dev, folder: Path):
    out = {}
    for kind in ("dflash", "dspark", "eagle3"):
        cfg = load_config(None, [f"policy.init={folder}", "steps=3", f"run_dir={folder.parent / ('run-' + kind)}",
                                 f"device={dev}", "rollout.dtype=bfloat16", "grpo.tis_cap=2.0",
                                 "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=24",
                                 "log.val_size=8", "log.val_every=3", "log.speedup_every=1", "log.checkpoint_every=3",
                                 f"draft.kind={kind}", "draft.init=random", "draft.gamma=3", "grpo.lr=1e-3"])
        t = Trainer(cfg, progress=False)
        t.fit()
        t.rollout_weights.check("after the run")
        assert t.rollout_weights.policy.layers[0].mlp.up_proj.weight.device.type == torch.device(dev).type
        out[kind] = str(t.run_dir)
    return out


def check_timing(dev):
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=100000.0)
    model = Transformer(cfg).to(dev).eval()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(RolloutWeights(model, dtype).policy)
        for b in (1, 8):
            prompts = [[(7 * i + j) % 49152 for j in range(32)] for i in range(b)]
            engine.generate(prompts, 8, temperature=0.0, eos_id=[])  # warm-up
            torch.cuda.synchronize() if dev.startswith("cuda") else None
            t = time.perf_counter()
            engine.generate(prompts, 128, temperature=0.0, eos_id=[])
            torch.cuda.synchronize() if dev.startswith("cuda") else None
            out[f"{dtype}/batch{b}"] = b * 128 / (time.perf_counter() - t)
    out["bf16_vs_fp32"] = {b: out[f"torch.bfloat16/batch{b}"] / out[f"torch.float32/batch{b}"] for b in (1, 8)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    ap.add_argument("--checks", default="engine,lossless,training,trainer,timing", help="comma list to run")
    args = ap.parse_args()
    dev = args.device
    summary = {"device": dev, "torch": torch.__version__,
               "name": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        policy, tok = tiny_policy()
        folder = Path(tmp) / "policy"
        save_pretrained(policy, folder, extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
        for name, fn in (("engine", check_engine), ("lossless", check_lossless), ("training", check_training),
                         ("trainer", lambda d: check_trainer(d, folder)), ("timing", check_timing)):
            if name not in args.checks.split(","):
                continue
            t = time.perf_counter()
            try:
                summary[name] = {"ok": True, "result": fn(dev)}
            except Exception as e:  # report every check, then fail
                failed = True
                summary[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            summary[name]["seconds"] = time.perf_counter() - t
            print(f"{name}: {'ok' if summary[name]['ok'] else 'FAILED ' + summary[name]['error']} "
                  f"({summary[name]['seconds']:.1f} s)", flush=True)
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
