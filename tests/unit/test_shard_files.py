"""The ranks' checkpoint part (``data_parallel.save_shards`` / ``load_shards``, torch.distributed.checkpoint) in
one process: the weights and AdamW state come back; a part that names the tensors it holds writes those
only; a folder written as codraft wrote them before 2026-12-06 (optimiser state by group index) loads."""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from codraft.parallel.data_parallel import load_shards, save_shards
from codraft.rl.update_phase import adamw
from tiny_runs import tiny_policy


def _trained(seed):
    torch.manual_seed(seed)
    policy, _ = tiny_policy()
    opt = adamw(policy.parameters(), lr=1e-2)
    policy(torch.randint(policy.config.vocab_size, (1, 12))).square().mean().backward()
    opt.step()
    return policy, opt


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _same_moments(a, b):
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[pa][k], b.state[pb][k])


def test_a_part_round_trips(tmp_path):
    policy, opt = _trained(0)
    save_shards({"policy": (policy, opt, None)}, tmp_path / "part")
    other, other_opt = _trained(1)  # other weights and moments, overwritten by the load
    load_shards({"policy": (other, other_opt, None)}, tmp_path / "part")
    _same(other, policy)
    _same_moments(other_opt, opt)


def test_a_part_holds_the_named_tensors_only(tmp_path):
    policy, opt = _trained(0)
    held = {n for n, _ in policy.named_parameters() if n.startswith("layers.0.")}
    save_shards({"policy": (policy, adamw([p for n, p in policy.named_parameters() if n in held]), held)},
                tmp_path / "part")
    saved = dcp.FileSystemReader(tmp_path / "part").read_metadata().state_dict_metadata
    assert {k.removeprefix("policy.") for k in saved if k.startswith("policy.")} == held


def test_a_folder_of_the_earlier_format_loads(tmp_path):
    policy, opt = _trained(0)
    dcp.save({"policy": get_model_state_dict(policy), "policy_optim": get_optimizer_state_dict(policy, opt)},
             checkpoint_id=tmp_path / "old")  # unflattened: param_groups by index
    assert "policy_optim.param_groups.0.lr" in dcp.FileSystemReader(tmp_path / "old").read_metadata().state_dict_metadata
    other, other_opt = _trained(1)
    load_shards({"policy": (other, other_opt, None)}, tmp_path / "old")
    _same(other, policy)
    _same_moments(other_opt, opt)
