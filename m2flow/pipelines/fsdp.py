"""FSDP2 sharding of the model that one data-parallel group trains
(``cluster.placement.components.learner.shard=fsdp``).

Each rank keeps 1/N of every parameter, of its gradient and of the optimiser state
(``torch.distributed.fsdp.fully_shard``); a sharded block gathers its parameters just before
its forward and frees them after, and its gradients are reduce-scattered in backward. Units:
every block of each innermost stack of repeated blocks (a transformer's layers, a ViT's
blocks: :func:`block_units`), then the root, which holds the rest (embeddings, heads). A
model whose work runs in methods other than ``forward`` (a policy's ``evaluate_actions``)
names them, and the root gathers its parameters around them too
(``register_fsdp_forward_method``); blocks must be called as modules (``block(x)``).

Gradients are *summed* over the ranks, not averaged (FSDP's default): each rank's loss is
its share of the global minibatch's mean, as in the unsharded data-parallel update
(:mod:`m2flow.runs.learner`), so a divide factor of 1 keeps the two updates equal. The
reduction is a plain SUM (``set_force_sum_reduction_for_comms``): gloo has neither AVG nor
PREMUL_SUM.

What leaves the group is whole: :func:`gather_state_dict` and :func:`gather_optimizer_state`
are collectives that hand rank 0 full CPU tensors (weight sync, checkpoints) in the layouts an
unsharded model writes (``Module.state_dict``, ``Optimizer.state_dict``), so a checkpoint of
a sharded run resumes unsharded and the other way round.

Imports torch only (engine level: no workload, no model class).
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
from torch import nn

from m2flow.pipelines.placement import SHARD_MODES  # noqa: F401  (none | fsdp)



def block_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one: the children of each innermost ``ModuleList`` or
    ``Sequential`` of at least two modules of one class that hold parameters and submodules
    (transformer layers, ViT blocks); a stack that contains such blocks is not one itself.

    >>> layer = lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> net = nn.Sequential(nn.ModuleList([layer(), layer()]), nn.Linear(2, 1))
    >>> [type(b).__name__ for b in block_units(net)], block_units(nn.Linear(2, 2))
    (['Sequential', 'Sequential'], [])
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> bool:  # True when ``module`` holds a chosen block
        found = [visit(c) for c in module.children()]
        if any(found):
            return True
        kids = list(module.children())
        if (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2
                and len({type(k) for k in kids}) == 1
                and all(any(True for _ in k.children()) and any(True for _ in k.parameters())
                        for k in kids)):
            units.extend(kids)
            return True
        return False

    visit(model)
    return units


def shard(model: nn.Module, *, device_type: str, world_size: int,
          forward_methods: Sequence[str] = (), param_dtype: Optional[torch.dtype] = None
          ) -> None:
    """Shards ``model`` in place over the default process group (all its ranks call this,
    with identical weights: FSDP does not broadcast them). ``device_type``: 'cpu' (gloo) or
    'cuda' (NCCL); ``forward_methods``: the model's methods that run it besides ``forward``;
    ``param_dtype``: the dtype blocks compute and all-gather in (e.g. bf16; gradients are
    still reduced in fp32, and the sharded masters stay fp32), None: the parameters' own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    # the outputs FSDP hooks are views at times (``value.squeeze(-1)``); nothing here writes
    # into them in place, which is what its warning is about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device_type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                              reduce_dtype=torch.float32 if param_dtype is not None else None)
    for block in block_units(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # a sum over the ranks (module docstring)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    for name in forward_methods:
        if hasattr(model, name):
            _register_method(model, name, register_fsdp_forward_method)


def _register_method(model: nn.Module, name: str, register) -> None:
    """Makes ``model.<name>`` gather the root's parameters around it, as ``forward`` does.

    FSDP's backward starts at hooks on the tensors a forward returns, and it finds them only
    in tuples, lists, dicts and dataclasses, not in a TensorDict (which a policy returns): the
    registered method is an inner one that also returns the output's tensors in a list (the
    same tensor objects: the hooks fire as the loss's gradient reaches them); the method
    under the old name hands back the output alone."""
    method = getattr(model, name)
    inner = f"_fsdp_{name}"

    def with_tensors(*args, **kwargs):
        out = method(*args, **kwargs)
        return {"out": out, "tensors": _tensors(out)}

    object.__setattr__(model, inner, with_tensors)
    register(model, inner)

    def outer(*args, **kwargs):
        return getattr(model, inner)(*args, **kwargs)["out"]

    object.__setattr__(model, name, outer)


def _tensors(out) -> list:
    """The tensors of a method's output: a tensor, or the leaves of a TensorDict."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = getattr(out, "values", None)
    if values is not None:
        try:
            return [v for v in values(include_nested=True, leaves_only=True)
                    if isinstance(v, torch.Tensor)]
        except TypeError:  # a plain mapping
            return [v for v in values() if isinstance(v, torch.Tensor)]
    return []


def _full_options(*, cpu_offload: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def gather_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A collective: the sharded ``model``'s whole state dict (parameters and buffers, names
    as ``state_dict`` writes them) as CPU tensors on rank 0; ``{}`` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full_options(cpu_offload=True))
    # buffers already on the CPU come back as the model's own tensors: copy them, or the
    # whole copy would change with the next update's statistics
    live = {b.data_ptr() for b in model.buffers()}
    return {k: v.clone() if v.data_ptr() in live else v for k, v in state.items()}


def load_state_dict(model: nn.Module, state: dict[str, torch.Tensor], *,
                    strict: bool = True) -> None:
    """Loads a whole state dict (the same on every rank) into the sharded ``model``: each rank
    keeps its shard. ``strict=False``: tensors ``state`` lacks keep their values. A
    collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_full_options(cpu_offload=False, strict=strict))


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A collective: ``optimizer``'s whole state on rank 0 (CPU), laid out as an unsharded
    ``optimizer.state_dict()`` (parameters numbered in ``model.parameters()`` order, the order
    the Trainer built the optimiser in); ``{}`` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    if not full:
        return {}
    ids = {name: i for i, name in enumerate(param_names(model))}
    return {"state": {ids[k]: v for k, v in full["state"].items()},
            "param_groups": [{**g, "params": [ids[k] for k in g["params"]]}
                             for g in full["param_groups"]]}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Loads a whole optimiser state (an unsharded ``optimizer.state_dict()``, the same on
    every rank) into the sharded ``optimizer``. A collective."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = param_names(model)
    full = {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=_full_options(cpu_offload=False))


def param_names(model: nn.Module) -> list[str]:
    """The names of ``model.parameters()``, in its order (a tied parameter once)."""
    return [name for name, _ in model.named_parameters()]


class GatheredModel:
    """Rank 0's whole copy (CPU) of a sharded model's state, refreshed by a collective
    (:meth:`gather`, every rank calls it), read like the model itself: ``state_dict`` gives
    its tensors, parameters as ``nn.Parameter`` with the model's ``requires_grad`` (what a
    weight sender reads to tell trained tensors from buffers). Empty on the other ranks."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.trains = {name: p.requires_grad for name, p in model.named_parameters()}
        self.state: dict[str, torch.Tensor] = {}

    def gather(self) -> None:
        self.state = gather_state_dict(self.model)

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        if not keep_vars:
            return dict(self.state)
        return {k: nn.Parameter(v, requires_grad=self.trains[k]) if k in self.trains else v
                for k, v in self.state.items()}

