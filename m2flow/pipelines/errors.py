"""Errors the engine raises for people to read."""


class PlacementError(ValueError):
    """A placement asks for resources the cluster does not have, or breaks its mode's rule."""


class WorkerError(RuntimeError):
    """A worker died, or a call on it failed; the message names the group, rank and method."""
