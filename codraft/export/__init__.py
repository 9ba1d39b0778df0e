"""Export a codraft draft to the folder layouts vLLM, SGLang and SpecForge / DeepSpec load.

    from codraft.export.write import export_draft     # draft folder or RUN_DIR/step_N -> folder
    from codraft.export.reader import load_exported   # an exported folder back into codraft

Modules: taps.py (tap-id conventions per stack), source.py (draft folder or run checkpoint in),
layout.py (dtype rules, the folder in memory), eagle3.py and block.py (the per-kind layouts),
write.py (checks and the atomic write), reader.py (the inverse), args.py (the ``export-draft``
arguments, free of torch so ``codraft --help`` stays instant) and cli.py (running it). The stacks'
commands and requirements: docs/serving.md.

Nothing is imported here: ``codraft.cli`` imports ``args`` when it builds its parser.
"""
