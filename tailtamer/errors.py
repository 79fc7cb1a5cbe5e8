"""User-facing errors: each message names the file, field or row at fault.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class TailtamerError(ValueError):
    """Bad input from the user (config, checkpoint, data, arguments)."""


class ConfigError(TailtamerError):
    """A config field or combination of fields is invalid."""


class CheckpointError(TailtamerError):
    """A model or drafter directory is missing, malformed or does not fit."""


class DataError(TailtamerError):
    """A dataset or prompts file is empty or has a bad row."""


class WriteError(TailtamerError):
    """A file could not be written (a full disk, a read-only directory); what was there before
    is left as it was."""
