"""The ranks' checkpoint part (``step_N/sharded/``, written by torch.distributed.checkpoint) read without
running code from it.

DCP's own reader unpickles ``.metadata`` with a plain ``pickle.load``, and its load planner reads each
non-tensor value (an optimiser's lr, betas, flags: a ``BYTE_IO`` item of a ``*.distcp`` file) with
``torch.load(weights_only=False)``: a planted file would run whatever it names, checksums or not (whoever
can edit the folder can edit ``state.json`` too). Here:

* ``read_metadata``: ``.metadata`` through an unpickler that imports only what DCP writes there (its
  metadata classes, ``torch.Size``, dtypes, layouts, memory formats, ``pathlib.PosixPath``);
* ``ShardReader``: DCP's ``FileSystemReader`` with that metadata, naming the file of a tensor item that
  fails (DCP reads those itself, with ``weights_only=True``);
* ``ShardPlanner``: DCP's default load planner with ``weights_only=True`` for the non-tensor items;
* ``check_shards``: the metadata and every non-tensor item read up front, so a checkpoint holding a
  planted one is refused, and skipped, before anything loads.

Every refusal is one ``TensorFileError`` naming the file.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from codraft.models.tensor_files import TensorFileError, refused

METADATA = ".metadata"

# what torch.distributed.checkpoint pickles into .metadata (torch 2.5 to 2.13), besides torch's dtypes,
# layouts and memory formats: every one builds plain data, none runs anything else
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # the checkpoint_id it was saved under
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()) or \
                (module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)):
            return super().find_class(module, name)
        # worded as torch's weights_only refusal, so ``refused`` names the global the same way
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_metadata(path: str | Path) -> Metadata:
    """A DCP ``.metadata`` file, refused (``TensorFileError``) when it names anything but DCP's metadata."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:
        raise refused(path, e) from e
    if not isinstance(metadata, Metadata):
        raise TensorFileError(f"{path} cannot be loaded: it holds a {type(metadata).__name__}, not "
                              "torch.distributed.checkpoint metadata")
    return metadata


def _load_item(data: io.BytesIO, where: str):
    try:
        return torch.load(data, weights_only=True, map_location="cpu")
    except Exception as e:
        raise refused(where, e) from e


def _item_file(folder: Path, relative_path: str) -> Path:
    """A data file the metadata points to: a plain name inside ``folder`` (DCP writes ``__R_N.distcp``)."""
    if Path(relative_path).name != relative_path or relative_path in ("", ".", ".."):
        raise TensorFileError(f"{folder / METADATA}: refused: it points outside its folder ({relative_path!r})")
    return folder / relative_path


def check_shards(folder: str | Path) -> Metadata:
    """Read ``folder``'s metadata and every non-tensor item as loading would, without loading any tensor:
    ``TensorFileError`` naming what is refused or unreadable."""
    folder = Path(folder)
    metadata = read_metadata(folder / METADATA)
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            path = _item_file(folder, info.relative_path)
            try:
                with open(path, "rb") as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
            except OSError as e:
                raise TensorFileError(f"{path} cannot be read ({e.strerror or e})") from e
            _load_item(io.BytesIO(data), f"{path} (item {index.fqn})")
    return metadata


class ShardReader(FileSystemReader):
    """``FileSystemReader`` reading ``.metadata`` with ``read_metadata``; a tensor item that fails to load is
    one error naming its file. (No ``rank`` argument: codraft writes one global ``.metadata``, so DCP never
    falls back to reading per-rank metadata files.)"""

    def read_metadata(self) -> Metadata:
        metadata = read_metadata(self._get_metadata_path())
        for info in metadata.storage_data.values():
            _item_file(Path(self.path), info.relative_path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path  # for the error below: DCP's read_data names no file
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except TensorFileError:
            raise
        except Exception as e:
            raise refused(Path(self.path) / (self._reading or "(a data file)"), e) from e


class ShardPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items read with ``weights_only=True``."""

    def __init__(self, folder: str | Path):
        super().__init__()
        self.folder = Path(folder)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        where = f"{self.folder / self.metadata.storage_data[read_item.storage_index].relative_path} (item {fqn})"
        obj = _load_item(value, where)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, but never weights_only=False
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
