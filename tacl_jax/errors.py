"""The errors a user can fix: each says in one line what is wrong and what to do about it.

``python -m tacl_jax.main`` and ``tacl_jax.convert`` print them as one log line and exit 1, without
a traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the run's input, config or environment, with its fix in the message."""


class ConfigError(UserError, ValueError):
    """A config value or combination that cannot run; the message names the key and what to use."""
