"""The one error type users see: a sentence that names the bad value and the fix."""


class IsotrainError(Exception):
    """A problem the user can fix; the CLI prints it as one line without a traceback."""


class ConfigError(IsotrainError):
    """An unknown, mistyped or inconsistent configuration value."""


class DataError(IsotrainError):
    """A missing, unreadable or unusable data file."""


class TrainingError(IsotrainError):
    """Training cannot go on without making garbage: a non-finite loss or gradient, a reward that always fails."""


class CheckpointError(IsotrainError):
    """A checkpoint could not be written, read or trusted."""
