"""The reward worker: scores each group as it arrives and passes it on to the learner."""

from __future__ import annotations

import torch

from m2flow import keys
from m2flow.pipelines import Channel, Worker
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.data import make_datasets
from m2flow.reasoning.model import load_tokenizer
from m2flow.reasoning.reward import reward_fn
from m2flow.reasoning.rollout_worker import decode


class RewardWorker(Worker):
    """Decodes completions and checks their answers (exact match or math-verify) on CPU, while
    the rollout worker generates the next groups."""

    def __init__(self, info, cfg: ReasoningConfig):
        super().__init__(info)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.train, _ = make_datasets(cfg.data, cfg.seed)
        self.score = reward_fn(cfg.algorithm.reward)

    def score_step(self, in_ch: Channel, out_ch: Channel, *, num_groups: int) -> dict:
        """Scores ``num_groups`` groups from ``in_ch`` (adds ``reward``) into ``out_ch``;
        returns the step's mean reward, accuracy, response length, and how many groups got
        one reward for all their completions (``train/groups_constant``)."""
        timeout = self.cfg.runner.channel_timeout_s
        rewards, lengths, constant = [], [], 0
        for _ in range(num_groups):
            with self.timer("wait"):
                group = in_ch.get(key=0, timeout=timeout)
            with self.timer("reward"):
                answer = self.train[int(group[keys.PROBLEM][0])].answer
                r = torch.tensor([self.score(t, answer) for t in decode(self.tokenizer, group)])
                group[keys.COMPLETION_REWARD] = r
            rewards.append(r)
            constant += bool((r == r[0]).all())  # no signal: its advantages are all 0
            lengths.append(group[keys.COMPLETION_MASK].sum(-1).float())
            out_ch.put(group, key=0, timeout=timeout)
        out_ch.flush()
        r, n = torch.cat(rewards), torch.cat(lengths)
        return {"train/reward": r.mean().item(), "train/accuracy": (r == 1).float().mean().item(),
                "train/response_len": n.mean().item(),
                "train/groups_constant": float(constant)}
