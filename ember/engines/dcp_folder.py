"""What would keep a DCP folder from loading, found before anything is loaded from it.

Both engines save through PyTorch's distributed checkpoint format: FSDP2 with `dcp.save`
(`model/`, `optim/`), Megatron with megatron-core's `torch_dist` strategy (one folder). Its
`.metadata` lists every item with the shard file, offset and length it occupies, so a
missing or cut-short shard shows from file sizes without reading it. The metadata is read
through `safe_pickle`'s allow-list, so a pickle that would run code is refused by name before
any loader sees the folder. The non-tensor entries (learning rates, betas, megatron-core's
sharded objects: a few small pickles in the shards) are read here only for a loader that
unpickles them without an allow-list (megatron-core's); the FSDP engine's `dcp.load` reads
them through `safe_pickle`'s planner as it loads.
"""
from __future__ import annotations

import io
import os
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ember.engines.safe_pickle import RefusedPickle, load_checkpoint_object, load_dcp_metadata

METADATA_FILE = ".metadata"


def dcp_folder_problem(folder: str, read_entries: bool = False) -> str | None:
    """None when `folder`'s metadata reads within the allow-list and every shard it lists is as long
    as it says (with `read_entries`, also every non-tensor entry unpickles with `weights_only`);
    else the first problem, naming the file."""
    metadata_file = os.path.join(folder, METADATA_FILE)
    if not os.path.isfile(metadata_file):
        return f"{metadata_file} is missing"
    try:
        metadata = read_metadata(folder)
        needed: dict[str, int] = {}  # shard file -> the bytes its items span
        for item in metadata.storage_data.values():
            needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    except RefusedPickle as refused:
        return str(refused)
    except Exception as error:  # a damaged pickle raises whatever its bytes lead to
        return f"{metadata_file} does not load, it is cut short or damaged ({type(error).__name__}: {error})"
    for name, size in sorted(needed.items()):
        shard = os.path.join(folder, name)
        if not os.path.isfile(shard):
            return f"{shard} is missing (its {METADATA_FILE} lists it)"
        if os.path.getsize(shard) < size:
            return f"{shard} is cut short: {os.path.getsize(shard)} bytes where its {METADATA_FILE} lists {size}"
    return _entries_problem(folder, metadata) if read_entries else None


def read_metadata(folder: str) -> Metadata:
    """`folder`'s DCP metadata, unpickled within the allow-list (`RefusedPickle` names a planted global)."""
    metadata_file = os.path.join(folder, METADATA_FILE)
    with open(metadata_file, "rb") as file:
        return load_dcp_metadata(file, metadata_file)


def saved_tensor_shapes(folder: str) -> dict[str, tuple[int, ...]] | None:
    """The tensors a DCP checkpoint folder holds with their full shapes, from its metadata; None when it has no
    readable one (another engine's format, or damage `dcp_folder_problem` reports when the checkpoint loads)."""
    if not os.path.isfile(os.path.join(folder, METADATA_FILE)):
        return None
    try:
        metadata = read_metadata(folder)
    except Exception:  # a damaged or refused pickle raises whatever its bytes lead to; the folder check names it
        return None
    return {name: tuple(item.size) for name, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)}


def _entries_problem(folder: str, metadata: Metadata) -> str | None:
    """The first non-tensor entry that does not unpickle (within torch's weights_only allow-list)."""
    by_shard: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for index, item in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            by_shard[item.relative_path].append((index.fqn, item))
    for name, entries in sorted(by_shard.items()):
        shard = os.path.join(folder, name)
        with open(shard, "rb") as file:
            for fqn, item in entries:
                source = f"{shard} (entry {fqn})"
                if item.transform_descriptors:  # ember's and megatron-core's writers apply none
                    return f"{source} is stored through {list(item.transform_descriptors)}, which ember does not read"
                file.seek(item.offset)
                try:
                    load_checkpoint_object(io.BytesIO(file.read(item.length)), source)
                except RefusedPickle as refused:
                    return str(refused)
                except Exception as error:
                    return f"{source} does not load, it is damaged ({type(error).__name__}: {error})"
    return None
