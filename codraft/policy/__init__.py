"""The policy a run starts from: name or folder resolution, and the tiny preset's SFT warm start."""
from codraft.policy.resolve import load_policy, resolve_policy_dir

__all__ = ["load_policy", "resolve_policy_dir"]
