"""The one error type of configuration problems, in a module of its own so that every config
module (validation, pipeline split, padding rules) can raise it without importing the others."""


class ConfigError(ValueError):
    """A configuration problem; the message names the file, override or key."""
