"""Fixtures shared by the integration tests of the RL trainer."""

import os
from pathlib import Path

import pytest
from rl_helpers import prepare_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model directory, tokenizer and arithmetic parquet files for one test module."""
    return prepare_inputs(tmp_path_factory.mktemp("rl-inputs"))


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module: CPU workers that import ember and these helpers as the driver does."""
    ray = pytest.importorskip("ray")
    path = os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    if ray.is_initialized():  # a Ray another test's run left up (its driver process is this one): start clean
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
