"""Reading back what an experiment tracker wrote offline, for the tests of `trainer.logger=wandb`.

wandb (0.31 and later has no Python reader of its own) writes an offline run as one
`.wandb` file in LevelDB's log format: a 7-byte file header, then 32 KiB blocks of records,
each behind a 7-byte header (crc, length, type); a record may be split across blocks.
Each record is a wandb protobuf `Record`. wandb's service process may still be writing the
file when `run.finish()` returns, so the reader waits for the run's closing `exit` record.
"""

from __future__ import annotations

import glob
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

_BLOCK = 32768
_FULL, _LAST = 1, 4


@dataclass
class OfflineWandbRun:
    project: str
    name: str
    config: dict[str, Any]  # top-level config keys, decoded
    history: dict[int, dict[str, Any]]  # step -> the row logged at that step


def read_offline_wandb_run(wandb_dir: str | Path, timeout_s: float = 60.0) -> OfflineWandbRun:
    """The single offline run under `wandb_dir` (what WANDB_DIR pointed to), once fully written."""
    [path] = glob.glob(str(Path(wandb_dir) / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    records = list(_records(path))
    while not any(record.WhichOneof("record_type") == "exit" for record in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)
        records = list(_records(path))
    runs, history = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    [run] = runs
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return OfflineWandbRun(run.project, run.display_name, config, history)


def _records(path: str) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"[:len(data)], f"{path} is not a wandb run file"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left_in_block < 7 or (kind == 0 and length == 0):  # padding up to the block's end
            position += left_in_block
            continue
        if position + 7 + length > len(data):  # still being written
            return
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
