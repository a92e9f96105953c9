"""A learned vector per task of a multi-task env, for the policies that read no instruction
(mlp, cnn, flow_mlp): their actor and critic see ``[features, E[task]]``.

A suite (LIBERO's, Meta-World's MT10/MT50) lists its tasks in ``EnvSpec.tasks`` and every
observation carries ``("obs", "task")``, the task's index there. A policy trained on the
suite's tasks mixed in one batch needs to know which task each row is; the VLAs read the
instruction's tokens, these policies a row of an ``nn.Embedding`` (``policy.task_embedding``
wide) indexed by the task, as multi-task RL baselines do (Meta-World's own MT-SAC appends a
one-hot; a learned table generalises it and stays small at LIBERO-90's 90 tasks).

>>> import torch
>>> emb = TaskEmbedding(3, 4)
>>> emb(torch.tensor([0, 2, 2])).shape
torch.Size([3, 4])
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from m2flow import keys
from m2flow.policies.base import PolicyError

FIELD = "policy.task_embedding"
WIDTH = 16  # the setting's default (mlp, cnn, flow_mlp)
INIT_STD = 1.0  # the table starts at N(0, 1), the scale of the normalised state beside it


class TaskEmbedding(nn.Module):
    """One learned row per task: ``forward(task (B,) int) -> (B, dim)``."""

    def __init__(self, n_tasks: int, dim: int):
        super().__init__()
        self.table = nn.Embedding(n_tasks, dim)
        nn.init.normal_(self.table.weight, std=INIT_STD)

    def forward(self, task: torch.Tensor) -> torch.Tensor:
        return self.table(task.long().reshape(-1))


def check(dim: int) -> None:
    """PolicyError naming the field for a negative width."""
    if dim < 0:
        raise PolicyError(f"{FIELD}={dim}: a width >= 0 (0: none).")


def build(dim: int, env_spec) -> Optional[TaskEmbedding]:
    """The embedding for ``env_spec``'s tasks, or None (one task, or ``dim`` 0)."""
    check(dim)
    n_tasks = len(env_spec.tasks)
    if dim == 0 or n_tasks < 2:
        return None
    return TaskEmbedding(n_tasks, dim)


def width(emb: Optional[TaskEmbedding]) -> int:
    """Features the embedding adds (0 for none)."""
    return 0 if emb is None else emb.table.embedding_dim


def append(emb: Optional[TaskEmbedding], features: torch.Tensor, obs) -> torch.Tensor:
    """``features`` (B, F) with the rows' task embeddings after them (B, F + dim); a
    PolicyError when the env's observations carry no task index."""
    if emb is None:
        return features
    task = obs.get(keys.leaf(keys.TASK), None)
    if task is None:
        raise PolicyError(f"{FIELD}: the env lists {emb.table.num_embeddings} tasks but its "
                          "observations carry no ('obs', 'task'); set policy.task_embedding=0 "
                          "or fix the env adapter.")
    return torch.cat([features, emb(task).to(features.dtype)], dim=-1)
