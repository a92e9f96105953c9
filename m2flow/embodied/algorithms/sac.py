"""``algorithm=sac``: soft actor-critic from a replay buffer (cleanRL's
``sac_continuous_action.py``, ManiSkill's SAC baseline), on the engine's one loop.

Each iteration's trajectories reach the learner as for PPO; ``prepare`` adds them to the
replay buffer (on the learner's device) and ``train``, its update loop, takes ``utd``
optimiser updates per transition added (fractions carry over to the next iteration), each on a
minibatch sampled uniformly from everything stored: the twin critics' regression on the soft
target, then, every ``policy_frequency`` updates, the actor's loss and the temperature's;
after each, the target critics trail the critics by Polyak averaging at ``tau``. Nothing
trains before the buffer holds ``learning_starts`` transitions. Collection and learning
overlap with ``runner.overlap_learner=true`` (the rollout acts with weights at most
``runner.max_staleness`` updates old). The policy must be a soft actor-critic
(``policy=sac_mlp``, ``sac_cnn``); the maths is in
:mod:`~m2flow.embodied.algorithms.helpers.offpolicy`.

RLPD is SAC with ``algorithm.demos=<m2flow-demos .h5>``: every minibatch draws
``demo_ratio`` of its rows from the demonstrations' transitions and the rest from the online
buffer (:class:`~m2flow.embodied.algorithms.helpers.replay.MixedSampler`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import (
    Algorithm, AlgorithmConfig, AlgorithmError, check_field)
from m2flow.embodied.algorithms.helpers.expert_data import read_demos
from m2flow.embodied.algorithms.helpers.offpolicy import (
    actor_loss, polyak_update, soft_q_target, temperature_loss)
from m2flow.embodied.algorithms.helpers.replay import (
    TRANSITION_KEYS, MixedSampler, ReplayBuffer, transitions)
from m2flow.runs.learner import Means, frozen_but, minibatch_generator


@dataclass
class SACConfig(AlgorithmConfig):
    """SAC's hyper-parameters (ManiSkill's SAC baseline's values for its state tasks)."""

    learning_rate: float = 3e-4
    """Adam step size of the actor."""
    critic_learning_rate: float = 3e-4
    """Adam step size of the twin critics."""
    alpha_learning_rate: float = 3e-4
    """Adam step size of the temperature's log."""
    max_grad_norm: Optional[float] = None
    """Global gradient-norm clip (None: none, as SAC's references)."""
    gamma: float = 0.8
    """Discount."""
    tau: float = 0.01
    """Polyak rate of the target critics (1: copy after every update)."""
    batch_size: int = 1024
    """Transitions per minibatch."""
    buffer_size: int = 1_000_000
    """Transitions the replay buffer keeps (the oldest go first)."""
    learning_starts: int = 4000
    """Transitions stored before the first update."""
    utd: float = 0.5
    """Updates per transition added (the update-to-data ratio)."""
    policy_frequency: int = 1
    """Critic updates per actor (and temperature) update."""
    autotune: bool = True
    """Learn the temperature towards ``target_entropy`` (False: alpha stays at the policy's
    ``init_alpha``)."""
    target_entropy: Optional[float] = None
    """The entropy the temperature steers to (None: minus the action dimension)."""
    demos: Optional[str] = None
    """RLPD: an m2flow-demos .h5 file (recorded with rewards) whose transitions make up
    ``demo_ratio`` of every minibatch (None: plain SAC)."""
    num_demos: Optional[int] = None
    """With ``demos``: its first N episodes (None: all)."""
    demo_ratio: float = 0.5
    """With ``demos``: the share of each minibatch drawn from them (RLPD: half)."""
    checkpoint_buffer: bool = True
    """Checkpoints hold the replay buffer, so a resumed run continues with it (False: a
    resumed run starts with an empty buffer and waits ``learning_starts`` again)."""

    def validate(self) -> None:
        super().validate()
        for field in ("critic_learning_rate", "alpha_learning_rate"):
            check_field(self, field, getattr(self, field) > 0, "must be > 0.")
        check_field(self, "gamma", 0 < self.gamma <= 1, "must be in (0, 1].")
        check_field(self, "tau", 0 < self.tau <= 1, "must be in (0, 1].")
        check_field(self, "batch_size", self.batch_size >= 1, "must be >= 1.")
        check_field(self, "buffer_size", self.buffer_size >= self.batch_size,
                    f"must hold at least a minibatch (algorithm.batch_size={self.batch_size}).")
        check_field(self, "learning_starts", 0 <= self.learning_starts <= self.buffer_size,
                    "must be in [0, algorithm.buffer_size].")
        check_field(self, "utd", self.utd > 0, "must be > 0 (updates per transition).")
        check_field(self, "policy_frequency", self.policy_frequency >= 1, "must be >= 1.")
        check_field(self, "demo_ratio", 0 < self.demo_ratio < 1,
                    "must be in (0, 1): the share of each minibatch from algorithm.demos.")
        check_field(self, "num_demos", self.num_demos is None or self.num_demos >= 1,
                    "must be >= 1, or null for every episode of algorithm.demos.")
        if self.demos is not None:
            check_field(self, "demos", Path(self.demos).expanduser().is_file(),
                        "no such file; record demonstrations in this run's env and obs mode "
                        "with m2flow-demos (e.g. m2flow-demos env=maniskill_pickcube "
                        "env.obs_mode=state demos.output=demos/PickCube-v1_state).")
            check_field(self, "demos", _has_rewards(self.demos),
                        "its episodes have no rewards (written before m2flow-demos recorded "
                        "them, or not by m2flow-demos); record it again with m2flow-demos.")


class SAC(Algorithm):
    """Soft actor-critic (see the module docstring)."""

    config_class = SACConfig

    def __init__(self, cfg, *, action_dim: int, seed: int):
        super().__init__(cfg, action_dim=action_dim, seed=seed)
        self.target_entropy = (-float(action_dim) if cfg.target_entropy is None
                               else float(cfg.target_entropy))
        self.demo_rows: Optional[TensorDict] = None  # RLPD: the demonstrations' transitions
        if cfg.demos is not None:
            episodes = read_demos(cfg.demos, action_dim, cfg.num_demos, transitions=True,
                                  field="demos")
            self.demo_rows = torch.cat(episodes).select(*TRANSITION_KEYS)  # (M,)
        self.sampler = None  # the buffer, or with demos the mix of both (at first use)
        self.buffer: Optional[ReplayBuffer] = None  # made on the learner's device at first use
        self.saved_buffer: Optional[dict] = None  # a checkpoint's, loaded into it then
        self.owed = 0.0  # updates earned by the transitions added, not yet taken
        self.updates = 0  # critic updates so far

    # -- the engine's hooks ------------------------------------------------------------------
    def prepare(self, policy, traj: TensorDict, *, iteration: int,
                staleness: int) -> tuple[TensorDict, dict]:
        """Adds the iteration's transitions to the replay buffer; they are the batch."""
        _check_single_rank(self.data_parallel)
        rows = transitions(traj)
        if self.buffer is None:
            self.buffer = ReplayBuffer(self.cfg.buffer_size, device=rows.device or "cpu")
            if self.saved_buffer is not None:
                self.buffer.load_state_dict(self.saved_buffer)
                self.saved_buffer = None
            self.sampler = self._sampler(rows)
        self.buffer.add(rows)
        self.owed += self.cfg.utd * rows.shape[0]
        return rows, {"replay/size": float(len(self.buffer))}

    def _sampler(self, rows: TensorDict):
        """The online buffer, or with ``demos`` a fixed-ratio mix of it and the demos."""
        if self.demo_rows is None:
            return self.buffer
        ours = sorted(map(str, rows.keys(True, True)))
        theirs = sorted(map(str, self.demo_rows.keys(True, True)))
        if ours != theirs:
            raise AlgorithmError(
                f"algorithm.demos={self.cfg.demos!r}: its transitions hold {theirs}, this env's "
                f"{ours}; record the demos with this env config (m2flow-demos env=...).")
        demos = ReplayBuffer(self.demo_rows.shape[0], device=self.buffer.device)
        demos.add(self.demo_rows)
        r = self.cfg.demo_ratio
        return MixedSampler({"online": self.buffer, "demos": demos},
                            {"online": 1 - r, "demos": r})

    def param_groups(self, policy, params: list) -> list[dict]:
        """The actor at ``learning_rate``; the critics and the temperature each at theirs
        (as ``lr_scale``s of it). The target critics take no steps."""
        _check_policy(policy)
        c = self.cfg
        by_id = {id(p): n for n, p in policy.named_parameters()}
        critic = set(policy.critic_parameter_names())
        alpha = set(policy.temperature_parameter_names())
        groups = {"actor": [], "critic": [], "alpha": []}
        for p in params:
            name = by_id.get(id(p), "")
            groups["critic" if name in critic else "alpha" if name in alpha else "actor"].append(p)
        return [{"params": groups["actor"]},
                {"params": groups["critic"], "lr_scale": c.critic_learning_rate / c.learning_rate},
                {"params": groups["alpha"], "lr_scale": c.alpha_learning_rate / c.learning_rate}]

    def train(self, policy, batch: TensorDict, trainer, *, iteration: int, seed: int) -> dict:
        """``owed`` updates (see the module docstring); the metrics are their means."""
        _check_policy(policy)
        c = self.cfg
        metrics = {"replay/size": float(len(self.buffer)), "loss/updates": 0.0}
        if len(self.buffer) < c.learning_starts:
            self.owed = 0.0  # updates are earned from learning_starts on
            return metrics
        steps = int(self.owed)
        self.owed -= steps
        gen, means = minibatch_generator(seed, iteration), Means()
        critic, actor = policy.critic_parameter_names(), policy.actor_parameter_names()
        if c.autotune:
            actor = actor + policy.temperature_parameter_names()
        for _ in range(steps):
            mb = self.sampler.sample(c.batch_size, generator=gen)
            with frozen_but(policy, critic):
                terms = trainer.gradients(mb, lambda m: self.critic_loss(policy, m))
                terms["grad_norm"] = trainer.step()
            if self.updates % c.policy_frequency == 0:  # (its grad_norm replaces the critics')
                with frozen_but(policy, actor):
                    terms.update(trainer.gradients(mb, lambda m: self.actor_loss(policy, m)))
                    terms["grad_norm"] = trainer.step()
            polyak_update(policy.critic_target.parameters(), policy.critic.parameters(),
                          tau=c.tau)
            self.updates += 1
            means.add(terms)
        metrics.update({f"loss/{k}": v for k, v in means.means().items()})
        metrics["loss/updates"] = float(steps)
        metrics["loss/alpha"] = float(policy.log_alpha.detach().exp())
        return metrics

    # -- the two losses -----------------------------------------------------------------------
    def critic_loss(self, policy, mb: TensorDict) -> TensorDict:
        """Both critics' squared error to the soft target (their sum of means)."""
        with torch.no_grad():
            next_obs = mb[keys.NEXT_OBS]
            next_action, next_log_prob = policy.sample(next_obs)
            next_q = policy.q_target(next_obs, next_action)  # (B, 2)
            target = soft_q_target(mb[keys.REWARD].float(), next_q[:, 0], next_q[:, 1],
                                   next_log_prob, terminated=mb[keys.TERMINATED],
                                   alpha=policy.log_alpha.exp(), gamma=self.cfg.gamma)
        q = policy.q(mb[keys.OBS], mb[keys.ACTION])  # (B, 2)
        loss = (q - target.unsqueeze(-1)).pow(2).mean(0).sum()
        return TensorDict({"loss_q": loss, "q_mean": q.detach().mean()}, batch_size=[])

    def actor_loss(self, policy, mb: TensorDict) -> TensorDict:
        """The actor's loss at the current alpha, and the temperature's (0 without
        ``autotune``); ``entropy`` is the minibatch's ``-log pi`` mean."""
        action, log_prob = policy.sample(mb[keys.OBS])
        q = policy.q(mb[keys.OBS], action)  # (B, 2)
        out = {"loss_actor": actor_loss(log_prob, q[:, 0], q[:, 1],
                                        alpha=policy.log_alpha.exp().detach()),
               "entropy": -log_prob.detach().mean()}
        if self.cfg.autotune:
            out["loss_alpha"] = temperature_loss(policy.log_alpha, log_prob,
                                                 target_entropy=self.target_entropy)
        return TensorDict(out, batch_size=[])

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The update counters and, with ``checkpoint_buffer``, the replay buffer."""
        keep = self.cfg.checkpoint_buffer and self.buffer is not None
        return {"owed": self.owed, "updates": self.updates,
                "buffer": self.buffer.state_dict() if keep else None}

    def load_state_dict(self, state: dict) -> None:
        """Restores the counters; a saved buffer is loaded into the buffer made on the
        learner's device when the first trajectories arrive."""
        self.owed, self.updates = float(state["owed"]), int(state["updates"])
        self.saved_buffer = state.get("buffer")

    def resume_note(self) -> str:
        saved = self.saved_buffer
        if saved is not None and saved["data"] is not None:
            return (f"replay buffer of {saved['data'].shape[0]:,} transitions from the "
                    "checkpoint")
        return ("no replay buffer in the checkpoint (algorithm.checkpoint_buffer=false when it "
                "was saved): it refills, and updates wait for algorithm.learning_starts="
                f"{self.cfg.learning_starts} transitions")


def _has_rewards(path: str) -> bool:
    """Whether the first episode of an .h5 file has what a transition needs beyond BC's
    observations and actions (an unreadable file passes: reading it says why)."""
    import h5py

    try:
        with h5py.File(Path(path).expanduser(), "r") as f:
            first = next((f[k] for k in f.keys() if k.startswith("traj_")), None)
            return first is None or all(k in first for k in ("rewards", "terminated",
                                                              "truncated"))
    except OSError:
        return True


def _check_single_rank(dp) -> None:
    if dp.active:
        raise ValueError("algorithm=sac trains on one learner rank; set "
                         "cluster.placement.components.learner.workers=1.")


def _check_policy(policy) -> None:
    if not getattr(policy, "soft_actor_critic", False):
        raise ValueError(f"algorithm=sac needs a soft actor-critic policy (twin critics and a "
                         f"temperature); {type(policy).__name__} is not one: use policy=sac_mlp "
                         "or policy=sac_cnn.")
