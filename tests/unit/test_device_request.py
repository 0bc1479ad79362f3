"""trainer.device: auto and cpu always work; an accelerator type the machine lacks is a config error."""

import pytest
import torch

from ember.config import ConfigError
from ember.distributed import device
from ember.trainer.rank_setup import use_configured_device


@pytest.fixture(autouse=True)
def back_to_auto():
    yield
    device.request_device("auto")


def test_cpu_is_honoured_and_auto_is_the_machines_device():
    use_configured_device("cpu")
    assert device.device_type() == "cpu" and device.current_device() == torch.device("cpu")
    use_configured_device("auto")
    machine = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    assert device.device_type() == machine


def test_an_accelerator_the_machine_lacks_is_a_config_error():
    missing = "npu" if torch.accelerator.is_available() else "cuda"
    with pytest.raises(ConfigError, match=f"trainer.device={missing}.*set trainer.device=auto"):
        use_configured_device(missing)
