"""A reward function that fails on every sample of a step stops the run with a UserError naming the
function and the first failure, instead of training on the constant failure_score and exiting 0;
`sys.exit` inside a reward is a failure of that sample, not the end of the run."""

from __future__ import annotations

import pytest

from ember.errors import UserError
from rl_helpers import run_overrides, train

BROKEN_REWARD = '''
import sys


def compute_score(data_source, solution_str, ground_truth, extra_info=None, how="raise"):
    if how == "raise":
        raise KeyError("answer")
    if how == "exit":
        sys.exit(0)
    return {"acc": 1.0}  # no score
'''


@pytest.mark.parametrize("how, workers, first_failure", [
    ("raise", 1, r"KeyError at .*broken_reward.py:\d+ \(data_source='ember/arithmetic/add2'\): 'answer'"),
    ("exit", 0, r"SystemExit at .*broken_reward.py:\d+"),
    ("no-score", 0, r"a dict without 'score'"),
])
def test_a_step_whose_every_sample_failed_to_score_stops_the_run(inputs, tmp_path, how, workers, first_failure):
    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text(BROKEN_REWARD)
    overrides = run_overrides(inputs, tmp_path / "run", f"custom_reward_function.path={reward_file}",
                              f"+custom_reward_function.reward_kwargs.how={how}", f"reward_model.num_workers={workers}",
                              "trainer.total_training_steps=2", "trainer.val_before_train=False")
    with pytest.raises(UserError, match=rf"step 1: reward function .*broken_reward.py:compute_score failed on every one "
                                        rf"of the 16 samples of this step.* the first failure: .*{first_failure}"):
        train(overrides)
    assert not (tmp_path / "run" / "global_step_1").exists()  # nothing was trained on the constant rewards
