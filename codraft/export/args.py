"""The ``codraft export-draft`` arguments: ``add_parser(subparsers)``. Imports nothing heavy (no torch),
so the ``codraft`` parser can be built with it on every start; cli.py runs the command.

    codraft export-draft DRAFT_DIR --target POLICY --out DIR [--dtype bfloat16] [--mask-token-id ID] [--force]
                         [--stack all|vllm|sglang|specforge]
    codraft export-draft RUN_DIR/step_N --out DIR [--dtype bfloat16]
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``export-draft``; the caller sets its ``fn`` (``codraft.export.cli.run``)."""
    s = subparsers.add_parser(
        "export-draft", help="write a draft (folder or run checkpoint RUN_DIR/step_N) in the layout vLLM, SGLang "
                             "and SpecForge load")
    s.add_argument("source", metavar="DRAFT_DIR", help="a saved draft folder, or a run checkpoint RUN_DIR/step_N")
    s.add_argument("--out", required=True, help="output folder (refused if it exists and is not empty, see --force)")
    s.add_argument("--target", help="draft folder only: the policy it was trained for (tiny-sft, smollm2-135m or an "
                                    "HF folder); a checkpoint carries its own")
    s.add_argument("--dtype", default="float32", help="weights' dtype: float32 (default), bfloat16 or float16")
    s.add_argument("--mask-token-id", type=int, help="DFlash/DSpark drafts with a learned MASK vector: the token id "
                                                     "MASK slots are fed as (one the policy never emits)")
    s.add_argument("--stack", choices=("all", "vllm", "sglang", "specforge"), default="all",
                   help="the stack the folder is for (all: the serving layout; the command says which stacks load "
                        "it). DSpark: vLLM and SGLang serve Qwen3DSparkModel, SpecForge trains DSparkDraftModel; "
                        "EAGLE-3 with the full vocabulary: only specforge writes d2t/t2d, which vLLM refuses")
    s.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return s
