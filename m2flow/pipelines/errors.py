"""Errors the engine raises for people to read."""


class PlacementError(ValueError):
    """A placement asks for resources the cluster does not have, or breaks its mode's rule."""


class WorkerError(RuntimeError):
    """A worker died, or a call on it failed; the message names the group, rank and method."""


class OutOfMemory(WorkerError):
    """A worker was killed because its machine ran out of memory (Ray's memory monitor); the
    message names the worker and, where Ray said, the node's memory used and its limit."""


def oom_summary(ray_message: str) -> str:
    """What Ray's out-of-memory text says, in one clause: the node's memory and who was killed.

    >>> oom_summary("1 worker(s) were killed due to the node running low on memory. Memory on "
    ...   "the node (IP: 10.0.0.2, ID: 71a) was 22.34GB used / 23.54GB limit (0.949)\\n"
    ...   "Selected to kill: (Actor(b08): job ID=01, task name=LearnerWorker.update, "
    ...   "pid=27872, actual memory used=1.65GB, worker ID=bed)")
    "killed by Ray's memory monitor with the node at 22.34GB used of 23.54GB (the killed process used 1.65GB)"
    """
    import re

    node = re.search(r"was ([\d.]+\s*[KMGT]?B) used / ([\d.]+\s*[KMGT]?B) limit", ray_message)
    killed = re.search(r"Selected to kill:.*?actual memory used=([\d.]+\s*[KMGT]?B)",
                       ray_message, re.S)
    text = "killed by Ray's memory monitor"
    if node:
        text += f" with the node at {node[1]} used of {node[2]}"
    if killed:
        text += f" (the killed process used {killed[1]})"
    return text
