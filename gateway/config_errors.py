"""The one error type of configuration, apart from the loader so every config section can raise it."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or malformed; the message names the key."""
