"""Parallelism applied to the plain models from outside: the degrees (``layout``), the ranks' DeviceMesh
(``mesh``), the whole layout applied once (``parallelize``) and the update's machinery it returns (``step``);
tensor (``tp``), data (``data_parallel``, ``sharded_stages``), context (``context``, ``ring``, ``zigzag``) and
pipeline parallelism (``pipeline``, ``stages``, ``tapchannel``); docs/architecture.md lists every module."""
