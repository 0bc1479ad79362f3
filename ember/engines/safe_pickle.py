"""Reading the pickles of a checkpoint without running code that came with it.

A checkpoint may come from elsewhere (a colleague's run, a download), and a pickle runs
whatever callable its `__reduce__` names. PyTorch's DCP pickles a folder's `.metadata`
(plain `pickle.load` on reading) and `torch.save`s each non-tensor entry of a state dict
(the optimizer's `param_groups`, megatron-core's sharded objects) into a shard, which its
default planner reads with `weights_only=False`. Here `.metadata` is unpickled with an
allow-list of exactly the globals that DCP (torch 2.13) and megatron-core's
dist_checkpointing (0.16) write there (listed from checkpoints both wrote, with pickletools;
every torch dtype, since a tensor may have any), and the entries are read with
`torch.load(weights_only=True)`. Any other global is refused before anything is called, with
a `RefusedPickle` naming the file and the global.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_DCP = "torch.distributed.checkpoint"

DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),  # where each item lies: shard file, offset, length
    ("torch.serialization", "_get_layout"),  # a TensorProperties' layout, rebuilt from its name
    ("torch", "Size"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),  # any tensor's
    # StorageMeta.checkpoint_id: the folder dcp.save was given (Python 3.13.0 names PosixPath's module pathlib._local)
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),
    # megatron-core keeps every rank's save plan in the metadata (Metadata.all_local_plans)
    *((f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
})
"""(module, name) of every global a DCP `.metadata` may reference."""


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint's pickle references a global that checkpoint files never hold; nothing of it was run."""

    def __init__(self, source: str, refused: str):
        super().__init__(f"{source} is refused: its pickle references {refused}, which is not on the allow-list "
                         "of what checkpoints hold (unpickling it could run code that came with the file)")
        self.source, self.refused = source, refused

    def __reduce__(self):  # DCP pickles a rank's error to gather it
        return RefusedPickle, (self.source, self.refused)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in DCP_METADATA_GLOBALS:
            raise RefusedPickle(self.source, f"{module}.{name}")
        return super().find_class(module, name)


def load_dcp_metadata(file: IO[bytes], source: str) -> Metadata:
    """The DCP `Metadata` pickled in `file` (read from `source`, named in errors), through the allow-list."""
    metadata = _MetadataUnpickler(file, source).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{source} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def load_checkpoint_object(file: IO[bytes], source: str) -> Any:
    """A non-tensor entry that DCP `torch.save`d into a shard, read with `weights_only=True`."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message advises weights_only=False first; the global it refused follows "GLOBAL "
        refused = re.search(r"GLOBAL ([\w.]+)", str(error))
        if refused is None:
            raise
        raise RefusedPickle(source, refused.group(1)) from None


class RestrictedFileSystemReader(FileSystemReader):
    """torch's `FileSystemReader` with `.metadata` unpickled through the allow-list (its `read_metadata`,
    torch 2.13's, otherwise unchanged); `dcp.load(..., storage_reader=...)` takes it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = load_dcp_metadata(metadata_file, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with each non-tensor entry read by `load_checkpoint_object` and
    put where the default's `load_bytes` (torch 2.13, `weights_only=False`) puts it;
    `dcp.load(..., planner=...)` takes it."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        entry = load_checkpoint_object(value, f"checkpoint entry {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], entry)
        else:
            self.state_dict[fqn] = entry
