"""The rollout worker: policy inference for the obs that arrive on a channel. Nothing else."""

from __future__ import annotations

import torch

from m2flow.embodied import seeding
from m2flow.pipelines import Channel, Worker
from m2flow.policies import PolicyConfig, make_policy


class RolloutWorker(Worker):
    """Holds an inference copy of the policy; serves the env ranks routed to it."""

    def __init__(self, info, cfg: PolicyConfig, env_spec, seed: int, channel_timeout: float = 600.0):
        super().__init__(info)
        self.policy = make_policy(cfg, env_spec).to(self.device).eval()
        self.seed = seed
        self.timeout = channel_timeout

    def set_weights(self, state_dict: dict) -> None:
        with self.timer("weight_sync"):
            self.policy.load_state_dict(state_dict)

    def serve(
        self, num_steps: int, obs_ch: Channel, act_ch: Channel, env_ranks: list[int],
        iteration: int, deterministic: bool = False,
    ) -> None:
        """Answers ``num_steps`` observations from each env rank routed to this rank.

        Sampling is seeded per (iteration, rank), so an iteration replays exactly on resume.
        """
        mine = [e for e in env_ranks if obs_ch.rank_of(e) == self.rank]
        cuda = [torch.device(self.device)] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seeding.derive(self.seed, seeding.SAMPLE, iteration, self.rank)[0])
            for _ in range(num_steps):
                for e in mine:
                    with self.timer("wait"):
                        batch = obs_ch.get(key=e, timeout=self.timeout)
                    with self.timer("infer"), torch.no_grad():
                        out = self.policy.act(batch.to(self.device), deterministic=deterministic)
                    with self.timer("send"):
                        act_ch.put(out.to("cpu"), key=e, timeout=self.timeout)
        act_ch.flush()
