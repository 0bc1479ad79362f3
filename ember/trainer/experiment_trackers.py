"""Experiment trackers as metric sinks: Weights & Biases (`wandb`) and MLflow (`mlflow`).

Both are optional packages (`pip install 'ember[wandb]'`, `pip install 'ember[mlflow]'`):
loading a configuration whose `trainer.logger` names one that is not installed fails with
that command (ember/config/validate.py), so the imports below only run where the package is.
Each sink opens one run named by `trainer.project_name` / `trainer.experiment_name`, records
the resolved configuration once, then the metrics of every step. Where a tracker writes is
its own package's setting, as in verl: `WANDB_MODE=offline` (no account needed) and
`WANDB_DIR` for wandb, `MLFLOW_TRACKING_URI` for MLflow (MLflow's own default when unset).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ember.config import ConfigError, config_to_dict

MLFLOW_PARAM_CHARS = 500  # MLflow's smallest limit on a parameter value across its releases
_MLFLOW_UNSAFE = re.compile(r"[^0-9A-Za-z_\-. /]")  # characters MLflow refuses in a metric name


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker names its run by and records once."""

    project_name: str  # trainer.project_name: wandb project, MLflow experiment
    experiment_name: str  # trainer.experiment_name: the run's name within it
    config: dict[str, Any]  # the resolved configuration, as plain data

    @classmethod
    def of(cls, cfg: Any) -> TrackedRun:
        """The run described by a loaded configuration (RL or SFT)."""
        return cls(cfg.trainer.project_name, cfg.trainer.experiment_name, config_to_dict(cfg))


WANDB_MODES_WITHOUT_LOGIN = ("offline", "disabled", "dryrun")  # WANDB_MODE values that send nothing


def check_tracker_login(loggers) -> None:
    """With wandb in `trainer.logger`, the run must have a wandb account to log to (or send nothing):
    otherwise `wandb.init` would stop the run after the models load, or wait at a login prompt."""
    if "wandb" not in loggers or os.environ.get("WANDB_API_KEY"):
        return
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_MODES_WITHOUT_LOGIN:
        return
    import wandb

    if not wandb.login(prompt=False, verify=False):
        raise ConfigError("trainer.logger names wandb but wandb is not logged in on this machine; run `wandb login` "
                          "(or set WANDB_API_KEY), or set WANDB_MODE=offline to keep the run's logs locally "
                          "(`wandb sync` uploads them later), or drop wandb from trainer.logger")


class WandbSink:
    """One wandb run: the configuration as its config, each step's metrics at that step."""

    def __init__(self, run: TrackedRun):
        import wandb

        self.run = wandb.init(project=run.project_name, name=run.experiment_name, config=run.config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """One MLflow run in the experiment named by the project: the configuration as parameters
    (values cut to MLFLOW_PARAM_CHARS) and whole as `config.json`, each step's metrics at that step."""

    def __init__(self, run: TrackedRun):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(run.project_name)
        self.run = mlflow.start_run(run_name=run.experiment_name)
        mlflow.log_params({key: str(value)[:MLFLOW_PARAM_CHARS] for key, value in flatten(run.config).items()})
        mlflow.log_text(json.dumps(run.config, indent=1, default=str), "config.json")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({_MLFLOW_UNSAFE.sub("_", key): value for key, value in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKER_SINKS = {"wandb": WandbSink, "mlflow": MlflowSink}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: the configuration's keys as a user writes them."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
