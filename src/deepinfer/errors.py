"""Exception types users can catch by name."""


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded: missing, inconsistent or corrupt files."""
