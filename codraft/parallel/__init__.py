"""Parallelism applied to a plain model from outside: context parallelism (zigzag ring with
branch attention: ``zigzag``, ``ring``, ``blocks``; the process group: ``comm``)."""
