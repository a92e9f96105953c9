"""The learner worker: one generic update loop on trajectories from a channel; what the
update computes (advantages, loss) is the algorithm's (``m2flow.embodied.algorithms``)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms import Algorithm, AlgorithmConfig, algorithm_class
from m2flow.pipelines import Channel, Worker
from m2flow.policies import PolicyConfig, make_policy
from m2flow.runs import checkpoint
from m2flow.runs.learner import Trainer
from m2flow.runs.weights import SyncPlan, WeightBucket, WeightSender

ADAM_EPS = 1e-5  # cleanRL's PPO value


class LearnerWorker(Worker):
    """Owns the trained policy, its ``Trainer`` (optimiser, fp32 masters) and the algorithm.

    ``algo_cfg`` is the config of algorithm ``algo_cfg.name`` (its registered config class).
    """

    def __init__(
        self, info, policy_cfg: PolicyConfig, algo_cfg: AlgorithmConfig, env_spec, *, seed: int,
        num_iterations: int, channel_timeout: float = 600.0,
    ):
        super().__init__(info)
        # first, before the policy is built: a bad algorithm config fails fast
        self.algorithm: Algorithm = algorithm_class(algo_cfg.name)(
            algo_cfg, action_dim=env_spec.action_dim, seed=seed)
        self.cfg = algo_cfg
        torch.manual_seed(seed)  # the initial weights: the same in every run with this seed
        self.policy = make_policy(policy_cfg, env_spec, device=self.device)
        self.seed = seed
        self.num_iterations = num_iterations
        self.timeout = channel_timeout
        self.trainer = Trainer(
            self.policy, lambda params: torch.optim.Adam(params, lr=algo_cfg.learning_rate,
                                                         eps=ADAM_EPS),
            precision=algo_cfg.precision, max_grad_norm=algo_cfg.max_grad_norm,
        )
        self.weights = WeightSender(self.policy)  # what the rollout copies were sent
        # Adam's moments appear at its first step; the context finds them in its state then
        self.context.register(modules={"policy": self.policy},
                              optimizers={"adam": self.trainer.optimizer})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    def get_weights(self) -> dict:
        """CPU copies of the policy's weights (trained ones fp32; a bf16 rollout copy casts
        them on load); works offloaded too (the copy is then host to host)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}

    def plan_weight_sync(self, *, full: bool, bucket_mb: float) -> SyncPlan:
        """Plans a sync of the policy to the rollout copies: everything (``full``; the first
        sync and the one after a load are full whatever is asked) or the trainable parameters
        and the buffers changed since the last sync, in buckets of ``bucket_mb`` MB; the
        buckets come from ``weight_bucket`` (see :mod:`m2flow.runs.weights`)."""
        return self.weights.plan(full=full, cap_bytes=max(1, int(bucket_mb * 2**20)))

    def weight_bucket(self, *, index: int) -> WeightBucket:
        """CPU copies of bucket ``index`` of the planned sync."""
        return self.weights.bucket(index)

    def state_dict(self) -> dict:
        """Weights and optimiser state in host memory (the driver that saves them may have no
        GPU; ``load_state_dict`` moves them back, see :mod:`m2flow.runs.checkpoint`)."""
        return {"policy": self.get_weights(),
                "optimizer": checkpoint.tree_to(self.optimizer.state_dict(), "cpu")}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.weights.reset()  # the rollout copies get all of the loaded weights

    def update(
        self, traj_ch: Channel, *, env_ranks: list[int], iteration: int, max_staleness: int = 0,
    ) -> dict:
        """One update on the trajectories of ``env_ranks`` (one (N, T) batch from each).

        The weights this update starts from are version ``iteration``; an action chosen with
        version v is ``iteration - v`` updates stale, and more than ``max_staleness`` is refused.
        """
        with self.timer("wait"):
            parts = [traj_ch.get(key=r, timeout=self.timeout) for r in env_ranks]
        staleness = check_staleness(parts, iteration, max_staleness)
        with self.timer("learn"):
            lr = self._learning_rate(iteration)
            self.trainer.set_lr(lr)
            traj = torch.cat(parts, dim=0).to(self.device)  # (N, T)
            spread = reward_spread(traj) if keys.REWARD in traj.keys(True) else None
            with self.trainer.autocast():  # prepare's forward passes (values) too
                batch, extra = self.algorithm.prepare(self.policy, traj, iteration=iteration,
                                                      staleness=staleness)  # (B,)
            metrics = self._epochs(batch, iteration) if batch.shape[0] else {}
            self.policy.observe(batch)  # statistics change between updates, never within one
            if spread is not None:  # (behaviour cloning's demonstrations have no reward)
                metrics["train/reward_spread"] = spread
            return {**metrics, **extra, "loss/learning_rate": lr,
                    "perf/staleness": float(staleness)}

    def _learning_rate(self, iteration: int) -> float:
        """A function of the iteration alone, so a resumed run uses the same schedule."""
        if not self.cfg.anneal_lr:
            return self.cfg.learning_rate
        return self.cfg.learning_rate * (1.0 - iteration / max(1, self.num_iterations))

    def _epochs(self, batch: TensorDict, iteration: int) -> dict:
        """Epochs x minibatches x micro-batches of the algorithm's loss; ``loss/*`` metrics."""
        a, c = self.algorithm, self.cfg
        terms = self.trainer.run_epochs(
            batch, lambda mb: a.loss(self.policy, mb), epochs=c.update_epochs,
            num_minibatches=c.num_minibatches, micro_batch_size=c.micro_batch_size,
            seed=self.seed, iteration=iteration, minibatch=a.minibatch, stop_early=a.stop_early,
        )
        metrics = {f"loss/{k}": v for k, v in terms.items()}
        metrics["loss/total"] = sum(v for k, v in metrics.items() if k.startswith("loss/loss_"))
        metrics.update(a.batch_metrics(batch))
        return metrics


def reward_spread(traj: TensorDict) -> float:
    """Largest minus smallest reward over the valid steps of ``traj`` (0: every step got the
    same reward, so there is nothing to learn from this batch).

    >>> t = TensorDict({"next": {"reward": torch.tensor([[0., 2.], [1., 5.]])},
    ...                 "valid": torch.tensor([[True, True], [True, False]])}, [2, 2])
    >>> reward_spread(t)
    2.0
    """
    r = traj[keys.REWARD].float()
    if keys.VALID in traj.keys():
        r = r[traj[keys.VALID]]
    return float(r.max() - r.min()) if r.numel() else 0.0


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
