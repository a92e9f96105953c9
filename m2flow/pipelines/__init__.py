"""The engine: cluster, placement, worker groups, channels and timers.

Knows nothing about RL maths or simulators (nothing here imports ``m2flow.embodied``,
``m2flow.reasoning``, ``m2flow.envs`` or ``m2flow.policies``).
"""

from m2flow.pipelines.channel import Channel, ChannelTimeout
from m2flow.pipelines.cluster import Cluster, ClusterConfig, NodeInfo
from m2flow.pipelines.context_switch import (
    ContextSwitcher,
    DeviceContext,
    SwitchStats,
    offloads_for,
)
from m2flow.pipelines.errors import OutOfMemory, PlacementError, WorkerDied, WorkerError
from m2flow.pipelines.placement import (
    ComponentPlacement,
    Placement,
    PlacementConfig,
    RankResources,
)
from m2flow.pipelines.timer import Timer
from m2flow.pipelines.futures import Futures
from m2flow.pipelines.worker import Peers, Worker, WorkerGroup, WorkerInfo

__all__ = [
    "Channel",
    "ChannelTimeout",
    "Cluster",
    "DeviceContext",
    "ClusterConfig",
    "ComponentPlacement",
    "ContextSwitcher",
    "Futures",
    "NodeInfo",
    "OutOfMemory",
    "Peers",
    "Placement",
    "PlacementConfig",
    "PlacementError",
    "RankResources",
    "SwitchStats",
    "Timer",
    "Worker",
    "WorkerDied",
    "WorkerError",
    "WorkerGroup",
    "WorkerInfo",
    "offloads_for",
]
