"""Checkpoint pickles as someone else could send them: a `__reduce__` payload planted in a DCP
folder's `.metadata` (alone, or inside otherwise valid metadata) or in one of its non-tensor entries,
and the globals a pickle looks up (what `safe_pickle`'s allow-list is checked against)."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"}


def pickled_globals(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle looks up (GLOBAL, or STACK_GLOBAL on two strings, memoised or not)."""
    found, pushed, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in STRING_OPS:
            pushed.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((pushed[-2], pushed[-1]))
        else:
            assert op.name not in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"), op.name
            pushed.append(None)
    return found


class Payload:
    """What a checkpoint from elsewhere could carry: unpickling it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_in_metadata(folder: Path, marker: Path, inside_valid_metadata: bool) -> None:
    metadata_file = folder / ".metadata"
    if inside_valid_metadata:  # the file stays well-formed DCP metadata; one attribute carries the payload
        metadata = pickle.loads(metadata_file.read_bytes())
        metadata.storage_meta.modules = [Payload(marker)]
        metadata_file.write_bytes(pickle.dumps(metadata))
    else:
        metadata_file.write_bytes(pickle.dumps(Payload(marker)))


def plant_in_entry(folder: Path, marker: Path, name_ends: str = ".lr") -> tuple[str, str]:
    """The first non-tensor entry whose name ends with `name_ends` (by default a learning rate) replaced by the
    payload, appended to its shard; returns the entry's name and its shard file."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    index, item = next((index, item) for index, item in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
                       and index.fqn.endswith(name_ends))
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    shard = folder / item.relative_path
    item.offset, item.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as file:
        file.write(payload.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn, item.relative_path
