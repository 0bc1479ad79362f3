"""`UserError`: an error in what the user gave, as opposed to a bug of ember.

Every `ember` command (and `torchrun -m ember.trainer.sft`) turns a `UserError` into
`error: <message>` and exit status 2, with no traceback (`trainer/command_line.py:
exit_status`); its message names the key, file or path at fault, says what is wrong with it
and what to do. Any other exception is a bug of ember and keeps its traceback.

Each layer raises its own subclass (`config.ConfigError`, `data.parquet.DatasetError`,
`rewards.RewardConfigError`), or `UserError` itself for a path or file none of them covers.
This module imports nothing, so that every layer can know it (reward worker processes
included) without depending on another.
"""


class UserError(Exception):
    """Something the user gave (a config key, a file, a path, an argument) cannot be used as given."""
