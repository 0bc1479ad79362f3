"""wandb and MLflow as `trainer.logger` names: refused at load time with the pip command when
the package is missing; where installed, runs named by the project and experiment with the
resolved config and every step's metrics, written offline into a temporary folder.

The tracker tests skip where the package is absent (CI installs only `.[test]`).
"""

import importlib.util

import pytest

from ember.config import ConfigError, SFTConfig, load_config
from ember.trainer.experiment_trackers import TrackedRun, flatten
from ember.trainer.loggers import MetricLogger
from tracker_files import read_offline_wandb_run

RUN = TrackedRun(project_name="ember-tests", experiment_name="tiny-grpo",
                 config={"trainer": {"project_name": "ember-tests", "logger": ["wandb"]}, "data": {"seed": 3}})
STEPS = {1: {"critic/score/mean": 0.5, "actor/pg_loss": -0.25}, 2: {"critic/score/mean": 0.75, "actor/pg_loss": 0.125}}


def without_package(monkeypatch, missing: str):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == missing else real_find_spec(name, *args))


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_fails_at_load_time_with_the_pip_command(monkeypatch, name):
    without_package(monkeypatch, name)
    for schema in (None, SFTConfig):
        arguments = {} if schema is None else {"schema": schema}
        with pytest.raises(ConfigError) as error:
            load_config([f"trainer.logger=['console','{name}']"], **arguments)
        assert f"the {name} package is not installed: pip install 'ember[{name}]'" in str(error.value)


def test_an_installed_tracker_is_accepted(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    assert load_config(["trainer.logger=['console','wandb','mlflow']"]).trainer.logger == ["console", "wandb", "mlflow"]


def test_config_keys_are_flattened_as_users_write_them():
    assert flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [2], "e": {}}


def log_steps(tmp_path, logger_name):
    logger = MetricLogger(str(tmp_path / "run"), [logger_name], total_steps=2, tracked_run=RUN)
    logger.start(None)
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.log(2, {"val-core/mean/acc": 1.0})  # validation is logged separately at the same step
    logger.close()


def test_wandb_offline_run_holds_the_names_config_and_every_step(offline_wandb):
    log_steps(offline_wandb, "wandb")
    run = read_offline_wandb_run(offline_wandb)
    assert (run.project, run.name) == ("ember-tests", "tiny-grpo")
    config, history = run.config, run.history
    assert config["trainer"] == RUN.config["trainer"] and config["data"] == {"seed": 3}
    for step, metrics in STEPS.items():
        assert {key: history[step][key] for key in metrics} == metrics
    assert history[2]["val-core/mean/acc"] == 1.0


def test_mlflow_run_in_a_file_store_holds_the_names_config_and_every_step(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this to use a folder
    log_steps(tmp_path, "mlflow")
    client = MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("ember-tests").experiment_id])
    assert run.info.run_name == "tiny-grpo"
    assert run.data.params["trainer.project_name"] == "ember-tests" and run.data.params["data.seed"] == "3"
    for key in STEPS[1]:
        history = client.get_metric_history(run.info.run_id, key)
        assert {metric.step: metric.value for metric in history} == {step: STEPS[step][key] for step in STEPS}
    assert run.data.metrics["val-core/mean/acc"] == 1.0


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A machine where nobody ran `wandb login`: no key in the environment or in ~/.netrc."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb-config"))
    wandb.teardown()
    yield
    wandb.teardown()


def sft_run_with_wandb(tmp_path):
    from fixtures import make_tiny_model_dir

    data = tmp_path / "train.parquet"
    data.write_bytes(b"")  # only its existence is checked before the run
    return load_config([f"model.partial_pretrain={make_tiny_model_dir(tmp_path)}", f"data.train_files={data}",
                        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=['console','wandb']"],
                       schema=SFTConfig)


def test_wandb_without_a_login_stops_the_run_before_any_work_saying_what_to_run(no_wandb_login, tmp_path,
                                                                                monkeypatch):
    from ember.trainer.sft import check_sft_config

    cfg = sft_run_with_wandb(tmp_path)
    with pytest.raises(ConfigError, match=r"wandb is not logged in.*`wandb login`.*WANDB_MODE=offline"):
        check_sft_config(cfg)
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_sft_config(cfg)
