"""The command line of a configured run, shared by `ember train` / `ember sft` (`ember/cli.py`)
and `torchrun -m ember.trainer.sft`: `--config-path/--config-name`, key=value overrides,
`--print-config`, `--describe`, and exit status 2 for an error the user must fix (`exit_status`,
the one place a `UserError` becomes a message).

The one thing to know: this module imports only the config package and `ember/errors.py`, and the
trainers reach it as functions passed in, so `ember --help` stays fast and no trainer module
imports `ember/cli.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.config import check_implemented, config_to_yaml, load_config
from ember.config.describe import describe_keys
from ember.errors import UserError

OVERRIDE_HELP = """\
overrides (Hydra grammar, as in verl run scripts):
  key=value           set a known key, e.g. actor_rollout_ref.rollout.n=8
  +key=value          add a key under a free-form mapping, e.g.
                      +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
  ++key=value         set or add
  ~key                delete a free-form key, or reset a key (not a whole section) to its default
Values are YAML: trainer.logger=['console','tensorboard'], null, 1e-6, true, 'quoted'.
Overrides apply after --config-name's file, in order; a repeated key keeps its last value.

--print-config prints the resolved configuration as YAML and runs nothing;
--describe [PREFIX] lists the keys under PREFIX with their defaults and descriptions.
"""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The options and positional overrides of a configured command (its --help ends with OVERRIDE_HELP)."""
    parser.add_argument("--config-path", "-cp", metavar="DIR", help="folder holding the config file (default: current folder)")
    parser.add_argument("--config-name", "-cn", metavar="NAME", help="config file inside --config-path, may contain slashes; .yaml optional")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration as YAML and exit")
    parser.add_argument("--describe", nargs="?", const="", metavar="PREFIX", help="list configuration keys under PREFIX and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides (see below)")


def config_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """All overrides of a `parse_known_args` result: argparse leaves those after an option in `extra`.
    Anything else in `extra` that looks like an option is an argparse error (exit 2)."""
    unknown_options = [item for item in extra if item.startswith("-")]
    if unknown_options:
        parser.error(f"unrecognized options: {' '.join(unknown_options)} (overrides are written key=value)")
    return args.overrides + extra


@dataclass(frozen=True)
class RunPlan:
    """What a configured command does with its loaded configuration."""

    run: Callable[[Any], int]  # the run itself; returns the exit status
    presets: list[str] = field(default_factory=list)  # overrides placed under the user's (the built-in demo's)
    checks: Callable[[Any], None] | None = None  # what the run checks first (paths, the model's sizes)
    feature_rows: list | None = None  # the command's own "not implemented yet" rows; None = its root's (features.py)


def run_configured(args: argparse.Namespace, overrides: list[str], schema: type,
                   plan: Callable[[Any], RunPlan]) -> int:
    """`--describe` or `--print-config` print and return 0; otherwise `plan(cfg).run` on the loaded
    configuration (reloaded with the plan's presets under `overrides`) once the plan's checks and the
    feature check passed."""
    if args.describe is not None:
        print(describe_keys(schema, args.describe), end="")
        return 0
    cfg = load_config(overrides, config_path=args.config_path, config_name=args.config_name, schema=schema)
    chosen = plan(cfg)
    if chosen.presets:
        cfg = load_config(chosen.presets + overrides, config_path=args.config_path, config_name=args.config_name,
                          schema=schema)
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    if chosen.checks is not None:
        chosen.checks(cfg)
    check_implemented(cfg, chosen.feature_rows)
    return chosen.run(cfg)


INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


def exit_status(command: Callable[[], int]) -> int:
    """`command()`'s status, or 2 after printing `error: <message>` (and no traceback) for a
    `UserError`, whose message names the key, file or path to change, or INTERRUPTED after one line
    for a Ctrl-C the run did not handle itself; any other exception is ember's own bug and propagates
    with its traceback."""
    try:
        return command()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no stop is handled (start-up) or a second one: not a bug
        print("stopped by Ctrl-C; nothing after the last checkpoint was saved (rerun with trainer.resume_mode=auto "
              "to go on from it)", file=sys.stderr)
        return INTERRUPTED
