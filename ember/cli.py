"""The `ember` command: train (RL), sft, preprocess, export, and `ember nla {train,sft,extract,eval}`.

Each subcommand imports its implementation only when it runs, so `ember --help` and
`--print-config` stay fast and work before every part of ember is installed. In every
subcommand a `UserError` (`ember/errors.py`: an unknown key, a bad value, a data file or row
not in the expected form, a missing path) prints `error: <message>` and exits with 2, with no
traceback (`command_line.exit_status`). The grammar of the configured
commands (overrides, --print-config, --describe) lives in `trainer/command_line.py`, which
`torchrun -m ember.trainer.sft` shares.
"""

from __future__ import annotations

import argparse
import sys

from ember import __version__
from ember.config import ConfigError, EmberConfig, SFTConfig
from ember.config.presets import BUILTIN_DEMO_OVERRIDES, is_builtin_demo
from ember.nla.commands import NLA_COMMANDS
from ember.trainer.command_line import (
    OVERRIDE_HELP,
    RunPlan,
    add_config_arguments,
    config_overrides,
    exit_status,
    run_configured,
)


def build_parser() -> argparse.ArgumentParser:
    """The `ember` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="ember", allow_abbrev=False,
        description="Post-training for LLMs: RL with verifiable rewards (GRPO, PPO), SFT and natural language autoencoders.")
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary in (("train", "train a policy with RL (GRPO, PPO, ...) from a verl-style config"),
                          ("sft", "supervised fine-tuning from a verl-style sft_trainer config")):
        sub = commands.add_parser(name, help=summary, description=summary, allow_abbrev=False, epilog=OVERRIDE_HELP,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        add_config_arguments(sub)
    nla = commands.add_parser("nla",
                              help="natural language autoencoders: train, sft, extract, eval (the NLA fork's run files)",
                              description="natural language autoencoders, with run files in the form of the verl NLA fork")
    nla_commands = nla.add_subparsers(dest="nla_command", required=True, metavar="NLA_COMMAND")
    for name, command in NLA_COMMANDS.items():
        default = f" (default: ember's {command.default_config})" if command.default_config else ""
        sub = nla_commands.add_parser(name, help=command.summary, description=command.summary + default,
                                      allow_abbrev=False, epilog=OVERRIDE_HELP,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        add_config_arguments(sub)
    commands.add_parser("preprocess", add_help=False,
                        help="prepare datasets as parquet (gsm8k, chat conversion, synthetic tasks); "
                             "`ember preprocess --help` lists the recipes")
    export = commands.add_parser("export", help="write a training checkpoint as a HF model folder loadable by transformers",
                                 description="write a training checkpoint as a HF model folder loadable by transformers")
    export.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="checkpoint folder written by ember train or ember sft")
    export.add_argument("output_dir", metavar="OUT_DIR", help="folder to write the HF model and tokenizer to (a LoRA "
                        "run's: PEFT's adapter folder, for PeftModel.from_pretrained on the base model)")
    export.add_argument("--merged", action="store_true",
                        help="a LoRA run: write the base model with the adapter merged in, as a HF model folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `ember` command with `argv` (default: sys.argv[1:]); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preprocess"]:  # the recipes own their arguments; pass them through untouched
        return exit_status(lambda: _run_preprocess(argv[1:]))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "sft", "nla"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "export":
        return exit_status(lambda: _run_export(args))
    overrides = config_overrides(parser, args, extra)
    if args.command == "nla":
        command = NLA_COMMANDS[args.nla_command]
        if args.config_path is None and args.config_name is None:
            args.config_name = command.default_config
        return exit_status(lambda: run_configured(args, overrides, command.schema, command.plan))
    if args.command == "sft":
        return exit_status(lambda: run_configured(args, overrides, SFTConfig, lambda cfg: RunPlan(_run_sft)))
    return exit_status(lambda: run_configured(args, overrides, EmberConfig,
                                              lambda cfg: _train_plan(cfg, args.config_name)))


def _train_plan(cfg: EmberConfig, config_name: str | None) -> RunPlan:
    """The built-in demo (its settings under the user's) when neither a model nor training data is named and
    no config file is given (a run file that names neither, e.g. an empty one, is a mistake, not a demo)."""
    if is_builtin_demo(cfg.actor_rollout_ref.model.path, cfg.data.train_files):
        if config_name is not None:
            raise ConfigError(f"--config-name {config_name} sets neither actor_rollout_ref.model.path nor "
                              "data.train_files (is the file empty?); set both in it or on the command line, or "
                              "leave out --config-name to run the built-in demo")
        return RunPlan(_run_builtin, presets=BUILTIN_DEMO_OVERRIDES)
    return RunPlan(_run_rl)


# The trainers are imported when they run, so that --help and --print-config stay fast.


def _run_rl(cfg: EmberConfig) -> int:
    from ember.trainer.rl import run_rl

    return run_rl(cfg)


def _run_builtin(cfg: EmberConfig) -> int:
    from ember.trainer.builtin import run_builtin

    return run_builtin(cfg)


def _run_sft(cfg: SFTConfig) -> int:
    from ember.trainer.sft import run_sft

    return run_sft(cfg)


def _run_preprocess(argv: list[str]) -> int:
    from ember.data.preprocess.command import build_parser as build_recipe_parser, run

    parser = argparse.ArgumentParser(prog="ember preprocess", description="prepare datasets as parquet files for ember")
    build_recipe_parser(parser)
    return run(parser.parse_args(argv))


def _run_export(args: argparse.Namespace) -> int:
    from ember.trainer.export import export_checkpoint

    export_checkpoint(args.checkpoint_dir, args.output_dir, merged=args.merged)
    return 0


if __name__ == "__main__":  # `python -m ember.cli ...`, as `python -m ember ...`
    raise SystemExit(main())
