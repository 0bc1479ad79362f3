"""Shared pytest setup: GPU tests are skipped on machines without CUDA, and torch uses one
CPU thread (the tiny test models are dominated by per-op overhead, which extra threads only
add to; on a shared 2-core machine one thread is several times faster). `--gguf PATH` names
real model weights for tests/gpu/test_real_model_gpu.py."""

import pytest
import torch

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--gguf", action="append", default=[], metavar="PATH",
                     help="a GGUF model file for tests/gpu/test_real_model_gpu.py (repeat for several; "
                          "EMBER_TEST_GGUF=PATH[,PATH] adds more)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb in offline mode (no account, nothing sent) writing under `tmp_path`; skips the test
    where wandb is not installed. wandb reads its environment once per process, so its state is
    torn down afterwards for the next test's folder to be used."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield tmp_path
    wandb.teardown()
