"""No pickle in a folder codraft reads runs code: a pickle whose ``__reduce__`` would run a shell command,
planted in each file codraft unpickles (the ranks' DCP part: its ``.metadata``, a non-tensor item and a tensor
item of a ``*.distcp`` file; a feature cache; an offline draft's resume state; a model draft's ``.pt``
weights; an exported draft's MASK vector), is refused in one line naming the file, and the command never runs. (A checkpoint's ``optim.pt``,
``rng.pt`` and ``draft.pt``: tests/integration/test_checkpoint.py and test_export_draft.py; a run's sharded
checkpoint resumed under torchrun: tests/distributed/test_dp_planted.py.)

Oracle for each: the marker file the command would create, and for DCP the premise that torch's own reader
and planner do run it."""
from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from codraft.drafts import build_draft
from codraft.drafts.model_draft import build as build_model_draft
from codraft.export.block import MASK_FILE
from codraft.export.reader import load_exported
from codraft.export.write import export_draft
from codraft.models import save_pretrained
from codraft.models.shard_files import ShardReader, check_shards
from codraft.models.tensor_files import TensorFileError
from codraft.parallel.data_parallel import FLAT, load_shards, save_shards
from codraft.rl.update_phase import adamw
from codraft.train.feature_cache import FeatureCache
from codraft.train.offline_draft import _restore
from tiny_runs import tiny_policy

RAN = f"(pickled GLOBAL '{os.system.__module__}.system'); codraft loads only tensors and plain data"


class _Touch:
    """Creates ``flag`` when unpickled by a loader that runs what a pickle names."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return os.system, (f"touch '{self.flag}'",)


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture
def part(tmp_path):
    """A trained tiny policy and its AdamW state written as the ranks' part (save_shards)."""
    torch.manual_seed(0)
    policy, _ = tiny_policy(layers=1, hidden=32)
    opt = adamw(policy.parameters(), lr=1e-2)
    policy(torch.randint(policy.config.vocab_size, (1, 8))).square().mean().backward()
    opt.step()
    save_shards({"policy": (policy, opt, None)}, tmp_path / "part")
    return tmp_path / "part", {"policy": (policy, opt, None)}


def _metadata(folder):
    with open(folder / ".metadata", "rb") as f:  # (the test's own file: unpickled as DCP does)
        return pickle.load(f)


def _plant_item(folder, fqn, payload: bytes):
    """Point item ``fqn`` of the metadata at ``payload``, in a data file of its own."""
    (folder / "__9_0.distcp").write_bytes(payload)
    md = _metadata(folder)
    index = next(i for i in md.storage_data if i.fqn == fqn)
    md.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(payload))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return folder / "__9_0.distcp"


def _one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_a_genuine_part_passes_the_checks(part):
    folder, parts = part
    md = check_shards(folder)
    assert md.state_dict_metadata.keys() == ShardReader(folder).read_metadata().state_dict_metadata.keys()
    assert md.state_dict_metadata.keys() == dcp.FileSystemReader(folder).read_metadata().state_dict_metadata.keys()
    load_shards(parts, folder)


def test_code_in_the_metadata_is_refused(part, tmp_path):
    """A genuine .metadata with a code-carrying object tucked inside (DCP would load it, then run normally)."""
    folder, parts = part
    flag = tmp_path / "ran"
    md = _metadata(folder)
    md.planner_data["policy.norm.weight"] = _Touch(flag)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    for load in (lambda: load_shards(parts, folder), lambda: check_shards(folder)):
        with pytest.raises(TensorFileError) as e:
            load()
        assert _one_line(e) == f"{folder / '.metadata'}: refused: it would run code when loaded {RAN}"
    assert not flag.exists()
    dcp.FileSystemReader(folder).read_metadata()  # the premise: DCP's own reader runs it
    assert flag.exists()


def test_a_metadata_that_is_no_metadata_is_refused(part):
    folder, parts = part
    (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(TensorFileError, match=r"\.metadata cannot be loaded: it holds a dict, not "
                                              "torch.distributed.checkpoint metadata$"):
        load_shards(parts, folder)
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(TensorFileError, match=r"\.metadata cannot be loaded \(UnpicklingError: "):
        check_shards(folder)


def test_code_in_a_non_tensor_item_is_refused(part, tmp_path):
    """An lr (a BYTE_IO item, which DCP's planner loads with weights_only=False) replaced by code."""
    folder, parts = part
    flag = tmp_path / "ran"
    fqn = "policy_optim.param_groups.norm.weight.lr"
    data = _plant_item(folder, fqn, _saved(_Touch(flag)))
    for load in (lambda: load_shards(parts, folder), lambda: check_shards(folder)):
        with pytest.raises(TensorFileError) as e:
            load()
        assert _one_line(e) == f"{data} (item {fqn}): refused: it would run code when loaded {RAN}"
    assert not flag.exists()
    policy, opt, _ = parts["policy"]
    state = {"policy": get_model_state_dict(policy),
             "policy_optim": get_optimizer_state_dict(policy, opt, options=FLAT)}
    dcp.load(state, storage_reader=ShardReader(folder))  # the premise: DCP's default planner runs it
    assert flag.exists()


def test_code_in_a_tensor_item_is_refused_naming_its_file(part, tmp_path):
    folder, parts = part
    flag = tmp_path / "ran"
    data = _plant_item(folder, "policy.norm.weight", _saved(_Touch(flag)))
    check_shards(folder)  # tensor items are left to the load (DCP reads them with weights_only=True)
    with pytest.raises(TensorFileError) as e:
        load_shards(parts, folder)
    assert _one_line(e) == f"{data}: refused: it would run code when loaded {RAN}"
    assert not flag.exists()


def test_a_metadata_pointing_outside_its_folder_is_refused(part, tmp_path):
    folder, parts = part
    (tmp_path / "elsewhere.distcp").write_bytes(_saved(0.5))
    md = _metadata(folder)
    index = next(i for i in md.storage_data if i.fqn == "policy_optim.param_groups.norm.weight.lr")
    md.storage_data[index] = _StorageInfo("../elsewhere.distcp", 0, 10)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    for load in (lambda: load_shards(parts, folder), lambda: check_shards(folder)):
        with pytest.raises(TensorFileError, match=r"\.metadata: refused: it points outside its folder "
                                                  r"\('\.\./elsewhere\.distcp'\)$"):
            load()


def _feature_cache(folder, payload):
    folder.mkdir()
    (folder / "identity.json").write_text(json.dumps({}))
    (folder / "tensors.pt").write_bytes(payload)
    return folder / "tensors.pt", lambda: FeatureCache.load(folder)


def _offline_state(folder, payload):
    folder.mkdir()
    (folder / "state.pt").write_bytes(payload)
    return folder / "state.pt", lambda: _restore(folder, None, None, None)


def _model_draft_weights(folder, payload):
    folder.mkdir()
    (folder / "draft.pt").write_bytes(payload)
    config = tiny_policy(layers=1, hidden=32)[0].config
    return folder / "draft.pt", lambda: build_model_draft(config, weights=folder / "draft.pt")


def _exported_mask(folder, payload):
    """A DFlash draft with a learned MASK vector exported (vLLM's mask_embedding.pt beside its weights)."""
    target = tiny_policy(layers=4, hidden=32)[0].eval()
    save_pretrained(target, folder / "policy")
    torch.manual_seed(0)
    draft = build_draft("dflash", target.config).bind_target(target.embed_tokens.weight, target.head_weight)
    draft.save(folder / "src")
    out = export_draft(folder / "src", folder / "out", target=str(folder / "policy"), mask_token_id=0).path
    (out / MASK_FILE).write_bytes(payload)
    return out / MASK_FILE, lambda: load_exported(out, target)


@pytest.mark.parametrize("plant", [_feature_cache, _offline_state, _model_draft_weights, _exported_mask])
def test_code_in_a_pickled_tensor_file_is_refused(tmp_path, plant):
    flag = tmp_path / "ran"
    path, load = plant(tmp_path / "folder", _saved({"embed_tokens.weight": _Touch(flag), "step": 3}))
    with pytest.raises(TensorFileError) as e:
        load()
    assert _one_line(e) == f"{path}: refused: it would run code when loaded {RAN}"
    assert not flag.exists()
