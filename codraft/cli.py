"""The `codraft` command. Each subcommand imports its machinery lazily so `--help` stays instant."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_sft(args):
    from codraft.warmstart import SFTConfig, warm_start
    cfg = SFTConfig(**({"steps": args.steps} if args.steps else {}), seed=args.seed)
    folder = warm_start(cfg, force=args.force)
    report = json.loads((folder / "sft.json").read_text())
    print(f"tiny policy: {report['parameters'] / 1e6:.2f} M parameters, "
          f"trained {report['train_seconds']:.0f} s, held-out accuracy {report['val_accuracy']:.1%}")
    print(folder)


def _cmd_prepare(args):
    from codraft.models.smollm2 import prepare_smollm2
    if args.name != "smollm2-135m":
        sys.exit(f"codraft prepare: unknown model {args.name!r}; available: smollm2-135m")
    print(prepare_smollm2())


def _cmd_train(args):
    from codraft.config import load_config
    cfg = load_config(args.config, args.overrides)
    try:
        from codraft.rl.trainer import train
    except ImportError:  # the RL trainer lands in a later change; until then `train` is the warm start
        print("codraft train: the RL trainer is not built yet; running the warm start (codraft sft)")
        return _cmd_sft(argparse.Namespace(steps=None, seed=cfg.seed, force=False))
    train(cfg, resume=args.resume)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="codraft", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("train", help="the main job: GRPO with speculative rollouts and a co-trained draft")
    s.add_argument("--config", help="preset name (tiny, smollm2-gsm) or YAML file; default: tiny")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    s.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=3 seed=7")
    s.set_defaults(fn=_cmd_train)

    s = sub.add_parser("sft", help="supervised warm start of the tiny policy on arith (cached)")
    s.add_argument("--steps", type=int)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--force", action="store_true", help="retrain even if cached")
    s.set_defaults(fn=_cmd_sft)

    s = sub.add_parser("prepare", help="build an HF-format folder of a packaged pretrained model")
    s.add_argument("name", help="smollm2-135m")
    s.set_defaults(fn=_cmd_prepare)

    args = p.parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        sys.exit(f"codraft {args.cmd}: error: {e}")


if __name__ == "__main__":
    main()
