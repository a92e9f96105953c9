"""The learner worker: advantages and PPO updates on trajectories from a channel. Nothing else."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied import seeding
from m2flow.embodied.advantages import gae
from m2flow.embodied.grpo import first_episodes, group_advantages, keep_groups
from m2flow.embodied.ppo import (
    LOGPROB_LEVELS,
    PPOConfig,
    grpo_loss,
    ppo_loss,
    total_loss,
)
from m2flow.pipelines import Channel, Worker
from m2flow.policies import PolicyConfig, make_policy


class LearnerWorker(Worker):
    """Owns the trained policy and its optimiser."""

    def __init__(
        self, info, policy_cfg: PolicyConfig, algo: PPOConfig, env_spec, seed: int,
        num_iterations: int, channel_timeout: float = 600.0,
    ):
        super().__init__(info)
        torch.manual_seed(seed)  # the initial weights: the same in every run with this seed
        self.policy = make_policy(policy_cfg, env_spec).to(self.device)
        self.algo = algo
        self.seed = seed
        self.num_iterations = num_iterations
        self.timeout = channel_timeout
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=algo.learning_rate, eps=1e-5)
        # Adam's moments appear at its first step; the context finds them in its state then
        self.context.register(modules={"policy": self.policy}, optimizers={"adam": self.optimizer})
        self.action_dim = env_spec.action_dim
        if algo.name not in ("ppo", "grpo"):
            raise ValueError(f"algorithm.name={algo.name!r}: use 'ppo' or 'grpo'.")
        if algo.logprob_level not in LOGPROB_LEVELS:
            raise ValueError(f"algorithm.logprob_level={algo.logprob_level!r}: use one of "
                             f"{list(LOGPROB_LEVELS)}.")

    def get_weights(self) -> dict:
        """CPU copies of the policy's weights; works offloaded too (the copy is then host to host)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}

    def state_dict(self) -> dict:
        return {"policy": self.get_weights(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])

    def update(
        self, traj_ch: Channel, env_ranks: list[int], iteration: int, max_staleness: int = 0,
    ) -> dict:
        """One PPO update on the trajectories of ``env_ranks`` (one (N, T) batch from each).

        The weights this update starts from are version ``iteration``; an action chosen with
        version v is ``iteration - v`` updates stale, and more than ``max_staleness`` is refused.
        """
        with self.timer("wait"):
            parts = [traj_ch.get(key=r, timeout=self.timeout) for r in env_ranks]
        staleness = check_staleness(parts, iteration, max_staleness)
        with self.timer("learn"):
            lr = self._learning_rate(iteration)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            traj = torch.cat(parts, dim=0).to(self.device)  # (N, T)
            extra = {}
            if self.algo.name == "grpo":
                extra = self._add_group_advantages(traj)
            else:
                self._add_advantages(traj, revalue=staleness > 0)
            flat = traj.reshape(-1)  # (N*T,)
            if keys.VALID in flat.keys():  # steps of episodes a simulator crash cut short
                flat = flat[flat[keys.VALID]]
            metrics = self._ppo_epochs(flat, iteration) if flat.shape[0] else {}
            self.policy.observe(flat)  # statistics change between updates, never within one
            return {**metrics, **extra, "loss/learning_rate": lr,
                    "perf/staleness": float(staleness)}

    def _learning_rate(self, iteration: int) -> float:
        """A function of the iteration alone, so a resumed run uses the same schedule."""
        if not self.algo.anneal_lr:
            return self.algo.learning_rate
        return self.algo.learning_rate * (1.0 - iteration / max(1, self.num_iterations))

    @torch.no_grad()
    def _add_advantages(self, traj: TensorDict, revalue: bool = False) -> None:
        """GAE with one critic throughout. ``revalue``: the trajectory was collected with older
        weights (learner overlap); its stored values come from an older critic, and mixing
        them with this critic's next-state values makes the returns off by about
        (V_new - V_old) * gamma / (1 - gamma * lambda), ~17x here, which the critic then
        chases until it diverges (measured: value loss 0.006 -> 9.7 in 12 iterations). So the
        values are recomputed; the behaviour log-probs stay (PPO's ratio needs them)."""
        if revalue:
            traj[keys.VALUE] = self.policy.value(traj[keys.OBS].reshape(-1)).reshape(traj.shape)
        next_obs = traj[keys.NEXT_OBS]
        traj[keys.NEXT_VALUE] = self.policy.value(next_obs.reshape(-1)).reshape(traj.shape)
        adv, ret = gae(
            traj[keys.REWARD], traj[keys.VALUE], traj[keys.NEXT_VALUE],
            traj[keys.TERMINATED], traj[keys.DONE],
            gamma=self.algo.gamma, gae_lambda=self.algo.gae_lambda,
        )
        traj[keys.ADVANTAGE], traj[keys.RETURN] = adv, ret

    @torch.no_grad()
    def _add_group_advantages(self, traj: TensorDict) -> dict:
        """GRPO: each env's first episode is one sample of its group; its advantage against
        the group goes to every step of it; other steps and filtered groups are not valid."""
        a = self.algo
        ret, success, steps = first_episodes(traj[keys.REWARD], traj[keys.DONE],
                                             traj[keys.SUCCESS])
        if keys.VALID in traj.keys():  # an episode a simulator restart lost is not a sample
            steps &= traj[keys.VALID]
            lost = ~traj[keys.VALID].all(1)
            success = success & ~lost
        keep = keep_groups(success, a.group_size, a.filter_low, a.filter_high)
        adv = group_advantages(ret, a.group_size)
        traj[keys.ADVANTAGE] = adv[:, None].expand(traj.shape).clone()
        traj[keys.RETURN] = ret[:, None].expand(traj.shape).clone()
        traj[keys.VALID] = steps & keep[:, None]
        return {"grpo/groups_kept": float(keep.float().mean()),
                "grpo/episode_success": float(success.float().mean()),
                "grpo/episode_return": float(ret.mean())}

    def _ppo_epochs(self, b: TensorDict, iteration: int) -> dict:
        a = self.algo
        gen = torch.Generator().manual_seed(seeding.derive(self.seed, seeding.LEARN, iteration, 0)[0])
        mb_size = max(1, b.shape[0] // a.num_minibatches)
        sums: dict[str, float] = {}
        count, stopped_early = 0, False
        for _ in range(a.update_epochs):
            perm = torch.randperm(b.shape[0], generator=gen)
            for start in range(0, b.shape[0], mb_size):
                mb = b[perm[start : start + mb_size].to(self.device)]
                if a.name == "grpo":
                    terms = grpo_loss(self.policy, mb, clip_coef=a.clip_coef,
                                      ent_coef=a.ent_coef, level=a.logprob_level,
                                      action_dim=self.action_dim)
                else:
                    terms = ppo_loss(
                        self.policy, mb, clip_coef=a.clip_coef, vf_coef=a.vf_coef,
                        ent_coef=a.ent_coef, clip_vloss=a.clip_vloss, norm_adv=a.norm_adv,
                    )
                loss = total_loss(terms)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.max_grad_norm)
                self.optimizer.step()
                for k, v in terms.items():
                    sums[k] = sums.get(k, 0.0) + float(v.detach())
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm)
                count += 1
            if a.target_kl is not None and float(terms["approx_kl"]) > a.target_kl:
                stopped_early = True
                break
        metrics = {f"loss/{k}": v / count for k, v in sums.items()}
        metrics["loss/total"] = sum(v for k, v in metrics.items() if "/loss_" in k)
        metrics["loss/early_stop"] = float(stopped_early)
        if a.name == "ppo":
            metrics["loss/explained_variance"] = _explained_variance(b[keys.VALUE], b[keys.RETURN])
        return metrics


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


def _explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    var = target.var()
    return float("nan") if var == 0 else float(1 - (target - pred).var() / var)
