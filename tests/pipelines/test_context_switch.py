"""Context switching: offload/onload round trips bit for bit (parameters, gradients, buffers,
Adam state), training continues exactly after a switch, tied weights move once, no-op mode on
CPU, who offloads follows the placement, worker groups take turns, and a training run with
switching ends on the same weights as one without."""

import pytest
import torch

from m2flow.cli.common import load_run_config
from m2flow.runs import checkpoint
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.pipelines import (
    Cluster,
    ClusterConfig,
    ComponentPlacement,
    ContextSwitcher,
    DeviceContext,
    NodeInfo,
    Placement,
    PlacementConfig,
    RankResources,
    Worker,
    WorkerGroup,
    offloads_for,
)


def model_and_adam(seed=0, device="cpu"):
    """A net with a BatchNorm (running stats are buffers) and Adam after one step."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 3)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    step(net, opt, seed)
    return net, opt


def step(net, opt, seed):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed)).to(net[0].weight.device)
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    opt.step()


def snapshot(net, opt):
    """Copies of every tensor a context moves: state_dict, grads, optimiser state."""
    out = {f"sd/{k}": v.detach().clone() for k, v in net.state_dict().items()}
    out |= {f"grad/{i}": p.grad.clone() for i, p in enumerate(net.parameters())}
    for i, state in enumerate(opt.state.values()):
        out |= {f"opt/{i}/{k}": v.clone() for k, v in state.items()}
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].device == b[k].device and torch.equal(a[k].cpu(), b[k].cpu()), k


def test_round_trip_is_bit_identical_and_frees_the_device_copies():
    net, opt = model_and_adam()
    before = snapshot(net, opt)
    ctx = DeviceContext("cpu", modules={"net": net}, optimizers={"adam": opt}, force=True)
    tensors = [*net.parameters(), net[1].running_mean, *(s["exp_avg"] for s in opt.state.values())]
    ptrs = [t.data_ptr() for t in tensors]
    # hold the old storages: once freed, the allocator may hand their addresses to the copies
    held = [t.untyped_storage() for t in tensors]

    out = ctx.offload()
    assert out.bytes == ctx.nbytes() > 0 and not ctx.on_device
    after = [p.data_ptr() for p in net.parameters()] + [net[1].running_mean.data_ptr()]
    after += [s["exp_avg"].data_ptr() for s in opt.state.values()]
    assert not set(ptrs) & set(after)  # nothing still points at the old storage
    del held
    assert_same(snapshot(net, opt), before)  # host copies hold the same bits

    assert ctx.onload().bytes == out.bytes
    assert_same(snapshot(net, opt), before)
    assert all(torch.is_tensor(s["step"]) and s["step"].dim() == 0 for s in opt.state.values())


def test_training_after_a_switch_equals_training_without_one():
    a, opt_a = model_and_adam(seed=1)
    b, opt_b = model_and_adam(seed=1)
    ctx = DeviceContext("cpu", modules={"net": b}, optimizers={"adam": opt_b}, force=True)
    ctx.offload()
    ctx.onload()
    for seed in (2, 3):
        step(a, opt_a, seed)
        step(b, opt_b, seed)
        ctx.offload()
        ctx.onload()
    assert_same(snapshot(a, opt_a), snapshot(b, opt_b))


def test_tied_weights_move_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    net = torch.nn.ModuleDict({"emb": emb, "head": head})
    ctx = DeviceContext("cpu", modules={"net": net, "head": head}, force=True)
    assert ctx.nbytes() == 10 * 4 * 4
    assert ctx.offload().bytes == 10 * 4 * 4
    assert head.weight is emb.weight and ctx.onload().tensors == 1


def test_cpu_without_force_is_a_no_op():
    net, opt = model_and_adam()
    ptr = net[0].weight.data_ptr()
    ctx = DeviceContext("cpu", modules={"net": net}, optimizers={"adam": opt})
    assert not ctx.active
    assert ctx.offload().bytes == 0 and ctx.onload().bytes == 0
    assert net[0].weight.data_ptr() == ptr


def placement(mode, rollout_gpus, learner_gpus):
    nodes = [NodeInfo("n0", "127.0.0.1", num_cpus=2, num_gpus=2)]
    comps = {"rollout": ComponentPlacement(gpus=rollout_gpus),
             "learner": ComponentPlacement(gpus=learner_gpus)}
    return Placement(PlacementConfig(mode=mode, components=comps), nodes)


def test_offloads_follow_the_placement():
    names = ["rollout", "learner"]
    both = {"rollout": ["learner"], "learner": ["rollout"]}
    none = {"rollout": [], "learner": []}
    shared = placement("collocated", [0], [0]).shares_device
    apart = placement("disaggregated", [0], [1]).shares_device
    assert offloads_for(shared, names) == both
    assert offloads_for(apart, names) == none
    assert offloads_for(shared, names, "never") == none
    assert offloads_for(apart, names, "always") == both
    with pytest.raises(ValueError, match="cluster.context_switch='sometimes'"):
        offloads_for(shared, names, "sometimes")


class Holder(Worker):
    """A worker that registers one Linear (4 x 3 weights + 3 biases: 60 bytes)."""

    def __init__(self, info):
        super().__init__(info)
        self.net = torch.nn.Linear(4, 3)
        self.context.register(modules={"net": self.net})

    def on_device(self):
        return self.context.on_device


def test_switcher_alternates_worker_groups_and_repeats_move_nothing():
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    groups = {n: WorkerGroup(cluster, n, Holder, [RankResources(0, 1.0, ())]) for n in "ab"}
    try:
        switcher = ContextSwitcher(groups, {"a": ["b"], "b": ["a"]}, force=True)
        first = switcher.activate("a")  # both start on the device: only b moves out
        assert first["switch/bytes"] == 60 and first["time/switch_onload"] == 0.0
        assert groups["b"].call(Holder.on_device).wait() == [False]
        second = switcher.activate("b")  # a out, b in
        assert second["switch/bytes"] == 120 and second["time/switch_offload"] > 0
        assert groups["a"].call(Holder.on_device).wait() == [False]
        assert switcher.activate("b")["switch/bytes"] == 0
    finally:
        for g in groups.values():
            g.shutdown()


TINY = [
    "cluster=inprocess",
    "env.num_envs=2",
    "runner.rollout_steps=16",
    "runner.num_iterations=2",
    "runner.eval_episodes=2",
    "runner.eval_interval=0",
    "runner.progress_bar=false",
    "policy.hidden_sizes=[32,32]",
]


def train(tmp_path, mode):
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        *TINY, f"runner.log_dir={tmp_path}", f"run_name={mode}", f"cluster.context_switch={mode}",
    ])
    runner = EmbodiedRunner(cfg)
    try:
        result = runner.train()  # evaluates and saves at the end, with the learner offloaded
    finally:
        runner.close()
    return result, checkpoint.load(result["checkpoint"])


def test_switching_every_turn_trains_to_the_same_weights(tmp_path):
    switched, a = train(tmp_path, "always")
    resident, b = train(tmp_path, "never")
    assert switched["time/switch_offload"] > 0 and switched["switch/bytes"] > 0
    assert "switch/bytes" not in resident
    for k, w in a["learner"]["policy"].items():
        assert torch.equal(w, b["learner"]["policy"][k]), k
    for i, state in a["learner"]["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["learner"]["optimizer"]["state"][i][k]), (i, k)
    assert switched["eval/success_once"] == resident["eval/success_once"]
    assert switched["eval/success_at_end"] == resident["eval/success_at_end"]


def test_overlap_with_switching_is_a_config_error():
    with pytest.raises(ValueError, match="runner.overlap_learner=true .* cluster.context_switch"):
        load_run_config("maniskill_pushcube_ppo_mlp", [
            *TINY, "cluster.context_switch=always", "runner.overlap_learner=true",
        ])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_uses_pinned_host_memory_and_frees_the_device():
    net, opt = model_and_adam(device="cuda")
    before = snapshot(net, opt)
    ctx = DeviceContext("cuda", modules={"net": net}, optimizers={"adam": opt})
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    out = ctx.offload()
    assert torch.cuda.memory_allocated() <= held - out.bytes
    assert all(p.device.type == "cpu" and p.is_pinned() for p in net.parameters())
    assert all(s["exp_avg"].is_pinned() for s in opt.state.values())
    ctx.onload()
    assert torch.cuda.memory_allocated() == held
    assert_same(snapshot(net, opt), before)
