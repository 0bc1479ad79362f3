"""The loop's part of a checkpoint: RNG states stored as plain tensors and numbers (loadable with
weights_only=True) that restore bit for bit, and every way the two files can be bad named."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ember.trainer.checkpoint import CheckpointProblem
from ember.trainer.run_state import RNG_FILE, STATE_FILE, read_run_state, save_run_state


def draws() -> tuple:
    """Numbers from every generator a checkpoint restores, the Gaussian caches included."""
    cuda = torch.rand(3, device="cuda").tolist() if torch.cuda.is_available() else None
    return (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
            torch.rand(3).tolist(), cuda)


def test_rng_states_restore_bit_for_bit_from_a_file_of_plain_tensors_and_numbers(tmp_path):
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    random.gauss(0, 1)  # leave a cached Gaussian in both Python's and numpy's state
    np.random.standard_normal()
    save_run_state(str(tmp_path), step=3, loader={"position": 3})
    expected = draws()

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    state = read_run_state(str(tmp_path), ["step", "loader"])
    assert draws() != expected  # reading checks the states but does not apply them
    state.restore_rng()
    assert draws() == expected
    assert state.values == {"step": 3, "loader": {"position": 3}}
    assert torch.load(tmp_path / RNG_FILE, weights_only=True)["format"] == 2


def test_an_rng_file_of_pickled_objects_is_refused_not_unpickled(tmp_path):
    save_run_state(str(tmp_path), step=1)
    # What earlier versions wrote: numpy's state as a pickled tuple with an ndarray.
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / RNG_FILE)
    # Refused either as pickled objects or, once megatron-core is imported (it adds numpy's
    # types to torch's safe globals), as a file of another format.
    with pytest.raises(CheckpointProblem, match="holds pickled Python objects|is not an RNG state of format 2") as error:
        read_run_state(str(tmp_path), ["step"])
    assert str(tmp_path / RNG_FILE) in str(error.value)


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (print, ("unpickled: this could have been any code",))


def test_an_rng_file_that_would_run_code_is_refused(tmp_path, capsys):
    save_run_state(str(tmp_path), step=1)
    torch.save({"format": 2, "python": RunsCodeWhenUnpickled()}, tmp_path / RNG_FILE)
    with pytest.raises(CheckpointProblem, match="holds pickled Python objects"):
        read_run_state(str(tmp_path), ["step"])
    assert "unpickled" not in capsys.readouterr().out


@pytest.mark.parametrize("damage, expected", [
    (lambda d: (d / RNG_FILE).write_bytes((d / RNG_FILE).read_bytes()[:200]), f"{RNG_FILE} does not load, it is cut short"),
    (lambda d: (d / RNG_FILE).unlink(), f"{RNG_FILE} is missing"),
    (lambda d: torch.save({"format": 2, "python": {}}, d / RNG_FILE), f"{RNG_FILE} holds an RNG state that does not restore"),
    (lambda d: torch.save({"torch": torch.get_rng_state()}, d / RNG_FILE), f"{RNG_FILE} is not an RNG state of format 2"),
    (lambda d: (d / STATE_FILE).write_text('{"step": 3, "loa'), f"{STATE_FILE} is not valid JSON, it is cut short"),
    (lambda d: (d / STATE_FILE).write_bytes(b"\xff\xfe garbage"), f"{STATE_FILE} is not valid JSON"),
    (lambda d: (d / STATE_FILE).unlink(), f"{STATE_FILE} is missing"),
    (lambda d: (d / STATE_FILE).write_text(json.dumps({"step": 3})), f"{STATE_FILE} lacks loader"),
])
def test_each_bad_file_is_named_with_what_is_wrong(damage, expected, tmp_path):
    save_run_state(str(tmp_path), step=3, loader={"position": 3})
    damage(tmp_path)
    with pytest.raises(CheckpointProblem) as error:
        read_run_state(str(tmp_path), ["step", "loader"])
    assert str(error.value).startswith(f"{tmp_path}/"), error.value
    assert expected in str(error.value)



@pytest.mark.parametrize("values, expected", [
    ({"step": "3"}, 'step="3", not a step count'),
    ({"step": -1}, "step=-1, not a step count"),
    ({"step": True}, "step=true, not a step count"),
    ({"loader": [3]}, "loader=[3], not a loader position"),
    ({"loader": {"position": 1.5}}, "not a loader position"),
    ({"kl_coef": None}, "kl_coef=null, not a finite number"),
    ({"validation_history": [[2, {"val/acc": "high"}]]}, "not a list of [step, {metric: number}] pairs"),
])
def test_a_value_of_the_wrong_type_is_named_before_anything_loads(values, expected, tmp_path):
    save_run_state(str(tmp_path), **{"step": 3, "loader": {"seed": 0, "epoch": 0, "position": 3}, "kl_coef": 0.1,
                                     "validation_history": [[2, {"val/acc": 0.5}]], **values})
    with pytest.raises(CheckpointProblem) as error:
        read_run_state(str(tmp_path), ["step", "loader"])
    assert expected in str(error.value)


def test_a_step_other_than_its_folders_is_not_trusted(tmp_path):
    folder = tmp_path / "global_step_4"
    folder.mkdir()
    save_run_state(str(folder), step=4, loader={"position": 4})
    assert read_run_state(str(folder), ["step"]).values["step"] == 4
    save_run_state(str(folder), step=400, loader={"position": 4})
    with pytest.raises(CheckpointProblem, match="has step=400 but sits in global_step_4"):
        read_run_state(str(folder), ["step"])
