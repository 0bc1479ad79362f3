"""A checkpoint from elsewhere cannot run code: a `__reduce__` planted in a pickle of a real checkpoint
(`.metadata`, or the optimizer's learning rate) is refused, naming the file and the global, by the
engine's pre-load check, by `ember sft`'s resume and by `ember export`, and by the engine's load
itself; it never runs. ember's own checkpoints (FSDP2 and Megatron) pass the check."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import make_tiny_model_dir
from planted_pickles import pickled_globals, plant_in_entry, plant_in_metadata

from ember.cli import main as ember_main
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_rows, sft_row_from_rl_row

REFUSED = "is refused: its pickle references posix.system, which is not on the allow-list"

# Where the payload goes in global_step_2/actor, and how the error names it (after the actor folder's path):
# a planted .metadata is refused by the check before any load, a planted entry by the load itself.
PLANTS = {
    "model metadata": (lambda actor, marker: plant_in_metadata(actor / "model", marker, inside_valid_metadata=False),
                       f"/model/.metadata {REFUSED}"),
    "optimizer metadata, inside valid metadata": (
        lambda actor, marker: plant_in_metadata(actor / "optim", marker, inside_valid_metadata=True),
        f"/optim/.metadata {REFUSED}"),
    "optimizer learning rate": (lambda actor, marker: plant_in_entry(actor / "optim", marker),
                                " does not load although every file is there and long enough, so bytes in it are "
                                f"damaged (RefusedPickle: checkpoint entry param_groups.0.lr {REFUSED}"),
}


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-pickles")
    rows = [sft_row_from_rl_row(row) for row in make_arithmetic_rows("add2", 8, seed=0)]
    return make_tiny_model_dir(root), write_parquet(rows, root / "train.parquet")


def sft_args(sft_inputs, run_dir, steps, *extra):
    model_dir, train_file = sft_inputs
    return ["sft", "data.multiturn.enable=true", f"data.train_files={train_file}", "data.max_length=64",
            f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]",
            "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", f"trainer.total_training_steps={steps}",
            "trainer.save_freq=1", *extra]


@pytest.fixture(scope="module")
def sft_run(sft_inputs, tmp_path_factory):
    """A 2-step `ember sft` run with checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("sft-pickles-run") / "run"
    assert ember_main(sft_args(sft_inputs, run_dir, 2)) == 0
    return run_dir


def planted_copy(sft_run, tmp_path, plant) -> tuple[Path, str, Path]:
    """A copy of the run with `plant` in global_step_2; the run, how an error names the plant, and the marker."""
    run_dir, marker = tmp_path / "run", tmp_path / "payload_ran"
    shutil.copytree(sft_run, run_dir)
    actor = run_dir / "global_step_2" / "actor"
    PLANTS[plant][0](actor, marker)
    return run_dir, f"{actor}{PLANTS[plant][1]}", marker


def printed_error(capsys) -> str:
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    return stderr[stderr.index("error: "):]


@pytest.mark.parametrize("plant", PLANTS)
def test_resume_path_refuses_a_planted_checkpoint_by_file_and_global(plant, sft_run, sft_inputs, tmp_path, capsys):
    run_dir, refusal, marker = planted_copy(sft_run, tmp_path, plant)
    checkpoint = run_dir / "global_step_2"
    assert ember_main(sft_args(sft_inputs, run_dir, 3, "trainer.resume_mode=resume_path",
                               f"trainer.resume_from_path={checkpoint}")) == 2
    assert printed_error(capsys).startswith(f"error: checkpoint {checkpoint} cannot be loaded: {refusal}")
    assert not marker.exists() and not (run_dir / "global_step_3").exists()


def test_auto_resume_steps_back_past_a_planted_checkpoint(sft_run, sft_inputs, tmp_path, caplog):
    run_dir, refusal, marker = planted_copy(sft_run, tmp_path, "optimizer metadata, inside valid metadata")
    with caplog.at_level(logging.WARNING, logger="ember.trainer"):
        assert ember_main(sft_args(sft_inputs, run_dir, 2)) == 0  # from step 1: step 2 again
    warning = next(record.message for record in caplog.records if "cannot be loaded" in record.message)
    assert f"cannot be loaded: {refusal}" in warning
    assert f"resuming from {run_dir / 'global_step_1'} instead" in warning
    assert not marker.exists()


def test_export_refuses_a_planted_model_and_never_reads_the_optimizer(sft_run, tmp_path, capsys):
    run_dir, refusal, marker = planted_copy(sft_run, tmp_path, "model metadata")
    checkpoint = run_dir / "global_step_2"
    assert ember_main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    assert printed_error(capsys).startswith(f"error: checkpoint {checkpoint} cannot be exported: {refusal}")
    assert not (tmp_path / "out").exists()

    PLANTS["optimizer learning rate"][0](run_dir / "global_step_1" / "actor", marker)
    assert ember_main(["export", str(run_dir / "global_step_1"), str(tmp_path / "out")]) == 0  # weights only
    assert not marker.exists()


@pytest.mark.parametrize("plant", PLANTS)
def test_the_engines_own_load_refuses_a_planted_pickle(plant, sft_run, sft_inputs, tmp_path):
    """Without the pre-load check, the FSDP engine's load reads the same pickles through the allow-lists."""
    from fsdp_engine_worker import engine_options

    from ember.engines.fsdp.engine import FSDPEngine

    clean = FSDPEngine(engine_options(str(sft_inputs[0])))
    assert clean.checkpoint_problem(str(sft_run / "global_step_2" / "actor")) is None
    run_dir, _, marker = planted_copy(sft_run, tmp_path, plant)
    with pytest.raises(BaseException, match="posix.system"):  # DCP wraps each rank's error (a BaseException)
        clean.load(str(run_dir / "global_step_2" / "actor"))
    assert not marker.exists()


MEGATRON_WORKER = """
import sys
from pathlib import Path
sys.path[:0] = [{integration!r}, {tests!r}]
from megatron_on_cpu import stand_in_cuda
stand_in_cuda()
from fsdp_engine_worker import make_batch, make_model_dir, mean_log_prob_loss
from ember.engines.megatron.engine import MegatronEngine
from ember.engines.megatron.options import MegatronOptions
from ember.engines.optim import OptimOptions

if __name__ == "__main__":
    work = Path(sys.argv[1])
    engine = MegatronEngine(MegatronOptions(model_path=make_model_dir("qwen2", str(work / "model")), role="actor",
                                            param_dtype="bfloat16", optim=OptimOptions(lr=1e-3, clip_grad=1.0)))
    engine.train_mini_batch(make_batch(samples=8), mean_log_prob_loss, micro_batch_size=4)
    engine.save(str(work / "checkpoint"))
"""


@pytest.mark.slow
def test_a_megatron_checkpoint_passes_the_check_and_a_planted_one_is_refused(tmp_path):
    """megatron-core's own load unpickles `.metadata` and its sharded objects without an allow-list: the check
    that resume and export make first reads both within one."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    from ember.engines.megatron.checkpoint import checkpoint_problem
    from ember.engines.safe_pickle import DCP_METADATA_GLOBALS

    worker = tmp_path / "write_megatron_checkpoint.py"
    here = Path(__file__).resolve().parent
    worker.write_text(MEGATRON_WORKER.format(integration=str(here), tests=str(here.parent)))
    subprocess.run([sys.executable, str(worker), str(tmp_path)], check=True, timeout=600)
    checkpoint, marker = tmp_path / "checkpoint", tmp_path / "payload_ran"
    assert pickled_globals((checkpoint / ".metadata").read_bytes()) <= DCP_METADATA_GLOBALS
    assert checkpoint_problem(str(checkpoint), []) is None

    entry_planted = tmp_path / "entry_planted"
    shutil.copytree(checkpoint, entry_planted)
    entry, shard = plant_in_entry(entry_planted, marker, name_ends=".optimizer/shard_0_1")  # its param_groups
    assert checkpoint_problem(str(entry_planted), []).startswith(f"{entry_planted / shard} (entry {entry}) {REFUSED}")
    plant_in_metadata(checkpoint, marker, inside_valid_metadata=True)
    assert checkpoint_problem(str(checkpoint), []).startswith(f"{checkpoint / '.metadata'} {REFUSED}")
    assert not marker.exists()
