"""The learner worker: one generic update on trajectories from a channel; what the update
computes (advantages: ``Algorithm.prepare``; its loop of optimiser steps: ``Algorithm.train``)
is the algorithm's (``m2flow.embodied.algorithms``), which steps through the worker's
:class:`~m2flow.runs.learner.Trainer`.

Several learner ranks (``cluster.placement.components.learner.workers=N``) train one policy
data-parallel: their group forms a torch.distributed process group (``forms_process_group``),
env workers are split among them in contiguous blocks (:func:`learner_rank`: env rank e goes
to learner rank ``e // (E / N)``, so rank 0 holds the first rows of the global batch, rank 1
the next, ...), each rank computes advantages on its own trajectories (GAE and GRPO groups
stay within one env worker, so within one rank), and the algorithm's loop takes the global
batch's minibatches from the Trainer, which sums their gradients over the ranks. What the
update reports is the global batch's on every rank; weights and checkpoints come from rank 0
(all ranks hold the same weights).

Sharded (``cluster.placement.components.learner.shard=fsdp``): the same update with the
policy's parameters, gradients and Adam state split over the ranks by FSDP2 (its transformer
blocks one by one, then the rest; :mod:`m2flow.pipelines.fsdp`). Whole weights exist only
where they are needed: after building, each update and each load, every rank takes part in
gathering them to rank 0's host memory (:class:`~m2flow.pipelines.fsdp.GatheredModel`),
which weight syncs read; a checkpoint's state (:meth:`LearnerWorker.state_dict`) is gathered
likewise, so the runner asks every rank for it. Checkpoints are the unsharded ones.
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms import Algorithm, AlgorithmConfig, algorithm_class
from m2flow.pipelines import Channel, Worker
from m2flow.pipelines.futures import resolve
from m2flow.pipelines.distributed import DataParallel
from m2flow.pipelines.fsdp import GatheredModel
from m2flow.policies import PolicyConfig, make_policy
from m2flow.policies.base import critic_tensor
from m2flow.runs.checkpoint import missing_weights
from m2flow.runs.learner import Trainer
from m2flow.runs.weights import SendsWeights, WeightSender

ADAM_EPS = 1e-5  # cleanRL's PPO value
NORMALISED = (keys.STATE, keys.PRIVILEGED)  # the flat observations policies keep statistics of
POLICY_METHODS = ("act", "evaluate_actions", "value")  # a sharded policy gathers around these


class LearnerWorker(SendsWeights, Worker):
    """Owns the trained policy, its ``Trainer`` (optimiser, fp32 masters) and the algorithm.

    ``algo_cfg`` is the config of algorithm ``algo_cfg.name`` (its registered config class).
    Its ranks train one policy together (see the module docstring).
    """

    forms_process_group = True

    def __init__(
        self, info, policy_cfg: PolicyConfig, algo_cfg: AlgorithmConfig, env_spec, *, seed: int,
        num_iterations: int, channel_timeout: float = 600.0,
    ):
        super().__init__(info)
        env_spec = resolve(env_spec)  # (launched before the env's spec was known: a Later)
        # first, before the policy is built: a bad algorithm config fails fast
        self.algorithm: Algorithm = algorithm_class(algo_cfg.name)(
            algo_cfg, action_dim=env_spec.action_dim, seed=seed)
        self.algorithm.data_parallel = self.data_parallel  # its statistics span the ranks
        self.cfg = algo_cfg
        torch.manual_seed(seed)  # the initial weights: the same in every run with this seed
        self.policy = make_policy(policy_cfg, env_spec, device=self.device)
        self.seed = seed
        self.num_iterations = num_iterations
        self.timeout = channel_timeout
        self.trainer = Trainer(
            self.policy,
            lambda params: torch.optim.Adam(self.algorithm.param_groups(self.policy, params),
                                            lr=algo_cfg.learning_rate, eps=ADAM_EPS),
            precision=algo_cfg.precision, max_grad_norm=algo_cfg.max_grad_norm,
            data_parallel=self.data_parallel, shard=info.resources.shard,
            forward_methods=POLICY_METHODS,
        )
        self.gathered: Optional[GatheredModel] = None  # sharded: rank 0's whole weights
        if self.trainer.sharded:
            self.gathered = GatheredModel(self.policy)
            self.gathered.gather()
        # what the rollout copies were sent (SendsWeights: rank 0 sends the syncs)
        self.weights = WeightSender(self.gathered or self.policy)
        if not self.trainer.sharded:  # (FSDP's shards do not move with the context: offload)
            # Adam's moments appear at its first step; the context finds them in its state then
            self.context.register(modules={"policy": self.policy},
                                  optimizers={"adam": self.trainer.optimizer})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    def offload(self) -> dict[str, float]:
        if self.trainer.sharded and self.context.active:
            raise RuntimeError(
                "cluster.placement.components.learner.shard=fsdp: a sharded learner cannot step "
                "aside for the rollout on a shared device yet (the context switch does not move "
                "FSDP's shards); give the learner devices of its own (placement mode "
                "disaggregated) or use shard=none.")
        return super().offload()

    def get_weights(self) -> dict:
        """CPU copies of the policy's weights (trained ones fp32; a bf16 rollout copy casts
        them on load); works offloaded too (the copy is then host to host). Sharded: rank 0's
        whole copy from the last gather (the other ranks hold none: ``{}``)."""
        if self.gathered is not None:
            return dict(self.gathered.state)
        return self.trainer.model_state_dict()

    def state_dict(self) -> Optional[dict]:
        """Weights, optimiser state and the algorithm's (``Algorithm.state_dict``: PPO's
        adapted step size) in host memory (the driver that saves them may have no GPU;
        ``load_state_dict`` moves them back, see :mod:`m2flow.runs.checkpoint`): rank 0's;
        None on the other ranks. Call it on every rank: sharded, it is a collective (the
        optimiser state is gathered); the layout is the unsharded one either way."""
        if self.trainer.sharded or self.rank == 0:  # (sharded: every rank takes part)
            optimizer = self.trainer.optimizer_state_dict()
        if self.rank != 0:
            return None
        return {"policy": self.get_weights(), "optimizer": optimizer,
                "algorithm": self.algorithm.state_dict()}

    def resume_note(self) -> str:
        """The algorithm's line on the state a resumed run continues with ('' : none)."""
        return self.algorithm.resume_note()

    def load_state_dict(self, state: dict) -> None:
        """Loads a checkpoint's state (every rank the same; sharded, each keeps its shard).
        A checkpoint from before algorithms had state has no ``algorithm``: the algorithm's
        stays as built."""
        self.trainer.load_model_state_dict(state["policy"])
        self.trainer.load_optimizer_state_dict(state["optimizer"])
        if "algorithm" in state:
            self.algorithm.load_state_dict(state["algorithm"])
        if self.gathered is not None:
            self.gathered.gather()
        self.weights.reset()  # the rollout copies get all of the loaded weights

    def init_weights(self, state: dict, *, source: str) -> list[str]:
        """Starts from another run's policy weights (``init_from``: every rank the same;
        sharded, a collective): the optimiser stays fresh. Tensors ``state`` lacks (a value
        head a BC run had no use for) keep their initial values; their names are returned.
        Critic tensors of ``state`` this policy has no place for (a BC run's value head, with
        ``policy.critic=privileged`` here) are not loaded.
        A tensor this policy has no place for, or of another shape, is one
        :class:`~m2flow.runs.checkpoint.CheckpointError` naming ``source``."""
        own = {k: v.shape for k, v in self.policy.state_dict().items()}  # (sharded: global)
        # a critic this policy does not have (BC's value head, where RL reads the simulator
        # state instead) is the checkpoint's only: BC never trains one
        state = {k: v for k, v in state.items() if k in own or not critic_tensor(k)}
        missing = missing_weights(own, state, source)
        self.trainer.load_model_state_dict(state, strict=not missing)
        if self.gathered is not None:
            self.gathered.gather()
        self.weights.reset()  # the rollout copies get all of the loaded weights
        return missing

    def update(
        self, traj_ch: Channel, *, env_ranks: list[int], iteration: int, max_staleness: int = 0,
    ) -> dict:
        """One update on the trajectories of ``env_ranks`` (one (N, T) batch from each; with
        several learner ranks, each reads its block of them, :func:`env_ranks_of`).

        The weights this update starts from are version ``iteration``; an action chosen with
        version v is ``iteration - v`` updates stale, and more than ``max_staleness`` is refused.
        """
        dp = self.data_parallel
        with self.timer("wait"):
            parts = [traj_ch.get(key=r, timeout=self.timeout)
                     for r in env_ranks_of(self.rank, env_ranks, self.world_size)]
        staleness = check_staleness(parts, iteration, max_staleness)
        if dp.active:  # every rank revalues alike (the oldest action of the global batch)
            staleness = int(dp.max(torch.tensor(staleness)))
        with self.timer("learn"):
            lr = self.algorithm.learning_rate(iteration, num_iterations=self.num_iterations)
            self.trainer.set_lr(lr)
            traj = torch.cat(parts, dim=0).to(self.device)  # (N, T)
            spread = reward_spread(traj, dp) if keys.REWARD in traj.keys(True) else None
            with self.trainer.autocast():  # prepare's forward passes (values) too
                batch, extra = self.algorithm.prepare(self.policy, traj, iteration=iteration,
                                                      staleness=staleness)  # (B,)
            rows = sum(dp.sizes(batch.shape[0]))  # of the global batch
            metrics = (self.algorithm.train(self.policy, batch, self.trainer,
                                            iteration=iteration, seed=self.seed)
                       if rows else {})
            # statistics change between updates, never within one; they see the global batch
            self.observe(observed_rows(batch, dp), iteration=iteration)
            if self.gathered is not None:  # the whole weights, for the sync that follows
                self.gathered.gather()
            if spread is not None:  # (behaviour cloning's demonstrations have no reward)
                metrics["train/reward_spread"] = spread
            # the step size at the end of the update (an adaptive one moved during it)
            return {**metrics, **mean_over_ranks(extra, dp),
                    "loss/learning_rate": self.trainer.lr, "perf/staleness": float(staleness)}

    def observe(self, batch: TensorDict, *, iteration: int) -> None:
        """Updates the policy's running statistics from ``batch``; during a critic-only update
        (PPO's ``critic_warmup``) only the critic's: the actor's input statistics stay as its
        weights do, so a warm-started actor acts exactly as its checkpoint did until the
        warm-up ends."""
        if not self.algorithm.critic_only(iteration):
            self.policy.observe(batch)
            return
        critic = set(self.policy.critic_buffer_names())
        kept = {n: b.detach().clone() for n, b in self.policy.named_buffers() if n not in critic}
        self.policy.observe(batch)
        with torch.no_grad():
            for n, b in self.policy.named_buffers():
                if n in kept:
                    b.copy_(kept[n])


def learner_rank(env_rank: int, env_workers: int, learners: int) -> int:
    """The learner rank that trains on env rank ``env_rank``'s trajectories: contiguous
    blocks of ``env_workers / learners`` env ranks (the start-up checks make it whole), so
    the ranks' batches in rank order are the one-learner batch.

    >>> [learner_rank(e, 4, 2) for e in range(4)]
    [0, 0, 1, 1]
    """
    return env_rank // max(1, env_workers // learners)


def env_ranks_of(rank: int, env_ranks: list[int], learners: int) -> list[int]:
    """The env ranks of ``env_ranks`` whose trajectories learner ``rank`` reads.

    >>> env_ranks_of(1, [0, 1, 2, 3], 2), env_ranks_of(0, [0, 1, 2], 1)
    ([2, 3], [0, 1, 2])
    """
    return [e for e in env_ranks if learner_rank(e, len(env_ranks), learners) == rank]


def observed_rows(batch: TensorDict, dp: DataParallel) -> TensorDict:
    """What ``Policy.observe`` (running observation statistics) is given: ``batch``, or with
    several ranks the state observations of the global batch, in rank order, the same on every
    rank (so their statistics, which sync to the rollout with the weights, stay identical).
    The policies' statistics read the flat observations: ``("obs", "state")`` and
    ``("obs", "privileged")``."""
    if not dp.active:
        return batch
    present = tuple(k for k in NORMALISED if k in batch.keys(True))
    seen = dp.gather_objects(present)  # every rank calls it: a collective
    if not present or any(tuple(p) != present for p in seen):
        return batch.select()
    rows = {k: dp.gather_rows(batch[k]) for k in present}  # (B_global, D) each
    return TensorDict(rows, batch_size=[rows[present[0]].shape[0]])


def mean_over_ranks(metrics: dict, dp: DataParallel) -> dict:
    """The metrics of ``prepare`` (means over each rank's envs; the ranks have equally many)
    averaged over the ranks: the global batch's."""
    if not dp.active or not metrics:
        return metrics
    names = sorted(metrics)
    sums = dp.sum(torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64))
    return {k: float(v) / dp.world_size for k, v in zip(names, sums)}


def reward_spread(traj: TensorDict, dp: Optional[DataParallel] = None) -> float:
    """Largest minus smallest reward over the valid steps of ``traj`` (0: every step got the
    same reward, so there is nothing to learn from this batch), over every rank of ``dp``.

    >>> t = TensorDict({"next": {"reward": torch.tensor([[0., 2.], [1., 5.]])},
    ...                 "valid": torch.tensor([[True, True], [True, False]])}, [2, 2])
    >>> reward_spread(t)
    2.0
    """
    r = traj[keys.REWARD].float()
    if keys.VALID in traj.keys():
        r = r[traj[keys.VALID]]
    if dp is None or not dp.active:
        return float(r.max() - r.min()) if r.numel() else 0.0
    inf = float("inf")
    hi, neg_lo = (float(r.max()), -float(r.min())) if r.numel() else (-inf, -inf)
    hi, neg_lo = dp.max(torch.tensor([hi, neg_lo], dtype=torch.float64)).tolist()
    return hi + neg_lo if hi > -inf else 0.0


def check_staleness(parts: list[TensorDict], iteration: int, max_staleness: int) -> int:
    """The most updates any action in ``parts`` lags behind version ``iteration``."""
    versions = [p[keys.POLICY_VERSION] for p in parts if keys.POLICY_VERSION in p.keys()]
    if not versions:
        return 0
    staleness = iteration - min(int(v.min()) for v in versions)
    if staleness > max_staleness:
        raise RuntimeError(
            f"learner: trajectory of iteration {iteration} holds actions {staleness} updates "
            f"stale, more than runner.max_staleness={max_staleness}; the runner let collection "
            "run too far ahead of the learner."
        )
    return staleness
