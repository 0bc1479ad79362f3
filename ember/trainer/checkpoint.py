"""Checkpoint directories of a run: `default_local_dir/global_step_N/`, written atomically,
pruned to the newest `keep`, found again on resume.

A checkpoint is written under a temporary name (`.global_step_N.tmp`) and renamed when every
file is in place, so a crash mid-save never leaves a directory that looks complete. The
newest complete step is also recorded in `latest_checkpointed_iteration.txt` (verl's name).
Steps are compared as numbers (global_step_10 comes after global_step_9), and keep-N prunes only
the run's own checkpoints: the ones it wrote and, after a resume from this folder, the ones up to
the step it resumed from, never another run's. What a resume does with the checkpoints found here
(check, load, fall back) is `resume.py`; who may write in the folder at all is `run_folder.py`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Callable

from ember.config import ConfigError

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRACKER_FILE = "latest_checkpointed_iteration.txt"

HF_CHECKPOINT_DIR = "huggingface"
"""A role's transformers folder inside its checkpoint folder (`checkpoint.save_contents` with hf_model, as verl)."""


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under `root` as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded. The message names the checkpoint folder and the bad
    file, says what is wrong and what to do; the `ember` command prints it and exits with 2."""


class CheckpointProblem(Exception):
    """One file of a checkpoint cannot be used; the message names the file and what is wrong with it.
    Resume and export turn it into a CheckpointError that names the checkpoint and what to do."""


def check_resume_path(path: str | None) -> None:
    """`trainer.resume_from_path` must name an existing `global_step_N` folder."""
    if not path or not os.path.isdir(path) or not STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise ConfigError(f"trainer.resume_from_path={path!r} is not a checkpoint folder; point it at a "
                          "global_step_N folder of a run (or set trainer.resume_mode=auto)")


class CheckpointManager:
    """Saves and finds the run's checkpoints; only rank 0 renames and prunes."""

    def __init__(self, root: str, keep: int | None, is_writer: bool = True, copy_to: str | None = None):
        self.root = root
        self.keep = keep
        self.copy_to = copy_to  # trainer.default_hdfs_dir: a folder each checkpoint is also copied to (never pruned)
        self.is_writer = is_writer
        self.written: set[int] = set()  # steps this run saved
        self.resumed_step: int | None = None  # the step of this folder the run resumed from, if any

    def resumed_at(self, step: int) -> None:
        """The run resumed from `global_step_<step>` of this folder: the checkpoints up to it are its past."""
        self.resumed_step = step

    def save(self, step: int, write: Callable[[str], None], barrier: Callable[[], None] = lambda: None) -> str:
        """Call `write(tmp_dir)` on every rank, then publish `global_step_N` atomically."""
        final = os.path.join(self.root, step_dir_name(step))
        tmp = os.path.join(self.root, f".{step_dir_name(step)}.tmp")
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        try:
            write(tmp)
        except Exception as error:
            if not _out_of_space(error):
                raise
            if self.is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._space_error(step) from error
        barrier()
        if self.is_writer:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            with open(os.path.join(self.root, TRACKER_FILE), "w", encoding="utf-8") as handle:
                handle.write(str(step))
            self.written.add(step)
            self._copy(final)
            self._prune()
        barrier()
        return final

    def _copy(self, checkpoint: str) -> None:
        """The checkpoint also to `copy_to` (verl's default_hdfs_dir on a local or mounted folder), through a
        temporary name like the checkpoint itself, so a copy cut short never looks complete."""
        if not self.copy_to:
            return
        target = os.path.join(self.copy_to, os.path.basename(checkpoint))
        partial = os.path.join(self.copy_to, f".{os.path.basename(checkpoint)}.tmp")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            shutil.copytree(checkpoint, partial)
        except OSError as error:
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(f"trainer.default_hdfs_dir={self.copy_to}: copying {checkpoint} there failed "
                                  f"({error}); the checkpoint itself is saved in {self.root}") from error
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)

    def _space_error(self, step: int) -> CheckpointError:
        free = shutil.disk_usage(self.root).free / 2**30
        kept = list_checkpoints(self.root)
        where = (f"the checkpoints before it are intact (newest: {os.path.basename(kept[-1][1])}); run again to resume "
                 "from it" if kept else "no earlier checkpoint of this folder exists")
        return CheckpointError(f"no space left on the device of {self.root} while saving {step_dir_name(step)} "
                               f"({free:.1f} GiB free now; its partial folder was removed); {where} after freeing space "
                               "or pointing trainer.default_local_dir at a larger disk")

    def _prune(self) -> None:
        """Deletes the run's own checkpoints but the newest `keep`."""
        if not self.keep or self.keep <= 0:
            return
        own = [path for step, path in list_checkpoints(self.root)
               if step in self.written or (self.resumed_step is not None and step <= self.resumed_step)]
        for path in own[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def resume_candidates(self, resume_mode: str, resume_from_path: str | None) -> list[str]:
        """The checkpoints a resume may start from, the preferred one first: `auto` every one
        under the root, newest first; `disable` none; `resume_path` the given one, which must exist."""
        if resume_mode == "disable":
            return []
        if resume_mode == "auto":
            return [path for _, path in reversed(list_checkpoints(self.root))]
        if resume_mode == "resume_path":
            check_resume_path(resume_from_path)
            return [resume_from_path]
        raise ValueError(f"trainer.resume_mode={resume_mode!r}; valid: auto, disable, resume_path")


def _out_of_space(error: BaseException) -> bool:
    """A full disk, raised here or in a worker process (whose error arrives wrapped, as text)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False
