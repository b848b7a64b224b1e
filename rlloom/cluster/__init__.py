"""Worker groups: `inline` (in the driver process) and `ray` (one actor per GPU or CPU slot)."""


class WorkerFailure(RuntimeError):
    """A worker died, raised or hung; the message names its rank, host and stage."""
