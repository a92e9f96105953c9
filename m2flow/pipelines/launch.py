"""Starting one rank of a worker group: as a Ray actor in a process of its own, or as an object
in this process (:class:`~m2flow.pipelines.worker.WorkerGroup` calls these with the rank's
``WorkerInfo``, its class's first constructor argument)."""

from __future__ import annotations

import os

from m2flow.pipelines.cluster import Cluster
from m2flow.pipelines.watchdog import WATCH_GROUP

MAX_CONCURRENT_CALLS = 16  # a worker serves channel puts while its own loop runs


def launch_ray_actor(cluster: Cluster, worker_cls: type, info, args, kwargs):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    res = info.resources
    threads = str(res.threads)
    env_vars = {
        # The worker picks its GPUs from the CUDA_VISIBLE_DEVICES it inherits (see
        # claim_gpus); Ray must not overwrite that variable before it does.
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        # An actor runs its calls on a pool of threads, and glibc gives each thread its own
        # malloc arena that keeps freed memory: a learner whose micro-batches change shape
        # grows far past its working set this way; two arenas keep it near it
        # (bench/README.md#reasoning_memorysh).
        "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
    }
    # the watchdog's question is answered on a thread of its own (pipelines.watchdog)
    actor_cls = ray.remote(concurrency_groups={WATCH_GROUP: 1})(worker_cls)
    return actor_cls.options(
        # Resources are accounted by Placement, not by Ray's logical counts, so that
        # collocated components may share cores and GPUs.
        num_cpus=0,
        num_gpus=0,
        max_concurrency=MAX_CONCURRENT_CALLS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            cluster.nodes[res.node].node_id, soft=False
        ),
        runtime_env={"env_vars": env_vars},
    ).remote(info, *args, **kwargs)


def construct_local(worker_cls: type, info, args, kwargs):
    try:
        return worker_cls(info, *args, **kwargs)
    except Exception as e:
        e.add_note(f"(raised while starting worker {info.group}[rank {info.rank}])")
        raise
