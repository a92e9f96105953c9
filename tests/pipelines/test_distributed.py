"""Process groups formed by worker groups from the placement: ranks, world size, master and
backend come from the cluster, not the user."""

import pytest
import torch

from m2flow.pipelines import Cluster, ClusterConfig, PlacementError, RankResources, Worker
from m2flow.pipelines import WorkerGroup, distributed


class Ranks(Worker):
    forms_process_group = True

    def joined(self) -> dict:
        import torch.distributed as dist

        return {"rank": dist.get_rank(), "world": dist.get_world_size(),
                "backend": dist.get_backend(), "sum": float(self.data_parallel.sum(
                    torch.tensor(float(self.rank + 1))))}

    def reduce_grads(self) -> dict:
        """p has a gradient on rank 0 only, q on no rank: p's sum, q stays None."""
        p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
        if self.rank == 0:
            p.grad = torch.tensor([1.0, 2.0, 3.0])
        self.data_parallel.sum_grads([p, q])
        rows = self.data_parallel.gather_rows(torch.full((self.rank + 1, 2), float(self.rank)))
        return {"p": p.grad.tolist(), "q": q.grad, "rows": rows.tolist()}


def test_two_ray_ranks_form_one_gloo_group_and_sum_over_it(ray_cluster):
    group = WorkerGroup(ray_cluster, "learner", Ranks, [RankResources(0, 1.0, ())] * 2)
    try:
        spec = group.process_group
        assert (spec.world_size, spec.backend) == (2, "gloo")
        assert spec.master_addr == ray_cluster.nodes[0].address and spec.master_port > 0
        joined = group.call(Ranks.joined).wait()
        assert [j["rank"] for j in joined] == [0, 1]
        assert all(j["world"] == 2 and j["backend"] == "gloo" and j["sum"] == 3.0 for j in joined)
        for out in group.call(Ranks.reduce_grads).wait():
            assert out["p"] == [1.0, 2.0, 3.0] and out["q"] is None
            assert out["rows"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    finally:
        group.shutdown()


def test_in_process_ranks_cannot_form_a_group():
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    with pytest.raises(PlacementError, match="learner.workers=2: data-parallel ranks"):
        WorkerGroup(cluster, "learner", Ranks, [RankResources(0, 1.0, ())] * 2)
    one = WorkerGroup(cluster, "learner", Ranks, [RankResources(0, 1.0, ())])
    try:  # one rank needs no group: its collectives return their input
        assert one.process_group is None and one.handles[0].data_parallel is distributed.SINGLE
    finally:
        one.shutdown()
