"""Errors of configuration loading; their messages are written for the user and say what to change.

Both are `UserError`s (`ember/errors.py`): the `ember` command prints `error: <message>` for
them and exits with status 2.
"""

from ember.errors import UserError


class ConfigError(UserError, ValueError):
    """The configuration cannot be used as given: unknown key, bad value, inconsistent sizes."""


class NotImplementedFeature(ConfigError):
    """The configuration asks for a feature whose key exists but whose code has not landed yet."""
