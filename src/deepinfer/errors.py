"""Exception types users can catch by name."""


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded: missing, inconsistent or corrupt files."""


class EngineDeadError(RuntimeError):
    """The engine cannot step again (a tensor-parallel worker died): every request fails,
    unlike an error one request caused, which fails that request alone (vLLM's name)."""
