"""Shared fixtures for the engine tests.

Ray worker processes import the classes defined in test modules (cloudpickle sends them by
reference), so the tests folder and the repository root must be on their ``PYTHONPATH``. The
raylet, and every worker it forks, inherits the driver's environment at ``ray.init``: setting
the variable while the cluster starts is enough.
"""

import os
import pathlib

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray (2 CPUs, small object store) for the whole session, shut down at the end.
    Skips where Ray is not installed (scripts/gpu_check.sh's GPU machine has none)."""
    pytest.importorskip("ray")
    from m2flow.pipelines import Cluster, ClusterConfig

    paths = [str(TESTS_DIR), str(REPO_ROOT)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(paths))
        cluster = Cluster(ClusterConfig(backend="ray", num_cpus=2, object_store_memory_mb=128))
    yield cluster
    cluster.shutdown()
