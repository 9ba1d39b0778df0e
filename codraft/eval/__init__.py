"""Evaluation of a policy on prompts and a reward: ``codraft eval`` and the trainer's in-run validation run
the same code (docs/eval.md).

Modules: evaluate.py (decode the prompts, score them with a ``RewardSet``, the figures), passk.py (the
unbiased pass@k estimator), source.py (what ``MODEL_OR_RUN`` names: a run, a checkpoint, a policy; its draft,
config, prompts and reward), report.py (the table and the JSON), args.py (the ``eval`` arguments, free of
torch so ``codraft --help`` stays instant) and command.py (running it).

Nothing is imported here: ``codraft.cli`` imports ``args`` when it builds its parser.
"""
