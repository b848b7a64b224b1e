"""Worker groups and their placement: base.py (the interface), local (one process) and ray
(actors), placement (colocated or separate GPU pools), build (the factory)."""

from rlloom.cluster.base import NoRoom, WorkerFailure

__all__ = ["NoRoom", "WorkerFailure"]
