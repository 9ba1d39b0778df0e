"""A probe of the precision products run in, shared by the precision, CP and PP step tests."""
import torch


class Products(torch.overrides.TorchFunctionMode):
    """Records every ``F.linear`` and ``torch.mm`` it sees (``nn.Linear`` and ``layers.linear`` are F.linear):
    its result's dtype and its first input's shape. Entered first, it sees the products that the modes
    entered after it pass on: under bf16 products, the bf16 ``mm`` they run (attention's products are
    neither: they stay fp32 by design)."""

    def __init__(self):
        super().__init__()
        self.dtypes, self.inputs = set(), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.nn.functional.linear, torch.mm):
            self.dtypes.add(out.dtype)
            self.inputs.append(tuple(args[0].shape))
        return out
