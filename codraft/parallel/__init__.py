"""Parallelism applied to a plain model from outside: context parallelism (zigzag ring with
branch attention: ``zigzag``, ``ring``, ``blocks``; the process group: ``comm``; the co-training
step's sharded view: ``context``; baselines: ``baselines``) and ``tapchannel``, the side channel
that will carry tapped features to the last pipeline stage."""
