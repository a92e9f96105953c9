"""The rollout worker: policy inference for the obs that arrive on a channel. Nothing else."""

from __future__ import annotations

import threading
from collections import Counter

import torch

from m2flow import keys
from m2flow.runs import seeding
from m2flow.runs.weights import ReceivesWeights, WeightReceiver
from m2flow.pipelines import Channel, Worker
from m2flow.pipelines.futures import resolve
from m2flow.policies import PolicyConfig, make_policy


class RolloutWorker(ReceivesWeights, Worker):
    """Holds an inference copy of the policy; serves the stages (env rank, stage) routed to it.

    Weights may arrive while it serves (learner overlap): a lock keeps each inference on one
    set of weights (``weight_lock``; a delta sync is staged and loaded at once, see
    :class:`~m2flow.runs.weights.ReceivesWeights`), and every action records the version of the
    weights that chose it.
    """

    stage_delta_syncs = True

    def __init__(self, info, cfg: PolicyConfig, env_spec, *, seed: int,
                 channel_timeout: float = 600.0):
        super().__init__(info)
        env_spec = resolve(env_spec)  # (launched before the env's spec was known: a Later)
        # seeded as the learner seeds its copy: without a checkpoint (evaluating initial
        # weights) every rank holds the run's initial weights, and no driver builds a copy
        torch.manual_seed(seed)
        self.policy = make_policy(cfg, env_spec, device=self.device).eval()
        self.context.register(modules={"policy": self.policy})  # offloaded while the learner runs
        self.seed = seed
        self.timeout = channel_timeout
        self.version = 0
        self.receiver = WeightReceiver(self.policy)
        self.served: Counter = Counter()  # requests answered per stage (env rank, stage)
        self.weight_lock = threading.Lock()

    def chunk(self) -> int:
        """Env steps per policy call (action chunks; 1 for single actions)."""
        return int(getattr(self.policy, "chunk", 1))

    def get_weights(self) -> dict:
        """CPU copies of the inference copy's weights (to compare with the learner's)."""
        with self.weight_lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}

    def weight_receiver(self) -> WeightReceiver:
        return self.receiver

    def serve(
        self, obs_ch: Channel, act_ch: Channel, *, stage_keys: list, num_steps: int,
        iteration: int, deterministic: bool = False, one_env_at_a_time: bool = False,
    ) -> None:
        """Answers ``num_steps`` observations on each stage of ``stage_keys`` (channel keys
        (env rank, stage)) routed to this rank.

        Stages are served in the order given, step after step (the runner lists them stage by
        stage, the order env workers send them in). Sampling is seeded per (iteration, rank),
        so an iteration replays exactly on resume. ``one_env_at_a_time``: the policy acts on
        each env's observation alone (``runner.eval_batch_invariant``), so its arithmetic
        never depends on the batch.
        """
        mine = [key for key in stage_keys if obs_ch.rank_of(key) == self.rank]
        cuda = [torch.device(self.device)] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seeding.derive(self.seed, seeding.SAMPLE, iteration, self.rank)[0])
            for _ in range(num_steps):
                for key in mine:
                    with self.timer("wait"):
                        batch = obs_ch.get(key=key, timeout=self.timeout)
                    with self.timer("infer"), torch.no_grad(), self.weight_lock:
                        out = self._act(batch.to(self.device), deterministic, one_env_at_a_time)
                        version = self.version
                    out = out.to("cpu")
                    out[keys.POLICY_VERSION] = torch.full(out.batch_size, version, dtype=torch.long)
                    with self.timer("send"):
                        act_ch.put(out, key=key, timeout=self.timeout)
                    self.served[key] += 1
        act_ch.flush()

    def _act(self, batch, deterministic: bool, one_env_at_a_time: bool):
        if not one_env_at_a_time or batch.batch_size[0] == 1:
            return self.policy.act(batch, deterministic=deterministic)
        return torch.cat([self.policy.act(batch[i:i + 1], deterministic=deterministic)
                          for i in range(batch.batch_size[0])])
