"""Small reasoning pieces the tests share: a tiny engine, scored groups, a learner."""

from __future__ import annotations

import torch

from m2flow.pipelines import RankResources, WorkerInfo
from m2flow.reasoning.config import GenerationConfig, ModelConfig, ReasoningConfig
from m2flow.reasoning.engine import HFEngine
from m2flow.reasoning.model import load_model


def tiny_engine(n_layers: int = 2, temperature: float = 1.0, max_new: int = 6,
                top_k: int = 0) -> HFEngine:
    """An ``hf`` engine on a seeded tiny Qwen2 (character tokenizer, 101 tokens)."""
    cfg = ModelConfig()
    cfg.tiny.num_hidden_layers = n_layers
    torch.manual_seed(0)
    model, tok = load_model(cfg)
    gen = GenerationConfig(max_new_tokens=max_new, temperature=temperature, top_k=top_k)
    return HFEngine(model, tok, gen, "cpu")


def scored_groups(engine: HFEngine, n_groups: int = 4, n: int = 4) -> list:
    """Groups of ``n`` sampled completions; even groups rewarded [1, 0, 0, 1] (a signal),
    odd ones all 1 (none)."""
    out = engine.generate([f"Q: {i}+{i}\nA:" for i in range(n_groups)], n, seed=1)
    groups = []
    for g in range(n_groups):
        grp = out[g * n : (g + 1) * n].clone()
        grp["problem"] = torch.full((n,), g)
        grp["policy_version"] = torch.zeros(n, dtype=torch.long)
        grp["reward"] = torch.tensor([1.0, 0.0, 0.0, 1.0]) if g % 2 == 0 else torch.ones(n)
        groups.append(grp)
    return groups


class ListChannel:
    """Stands for a ``Channel`` the learner reads scored groups from."""

    def __init__(self, items):
        self.items = list(items)

    def get(self, key=0, timeout=None):
        return self.items.pop(0)


def learner_config(micro_batch: int = 8, kl_coef: float = 0.05) -> ReasoningConfig:
    cfg = ReasoningConfig()
    cfg.model.tiny.num_hidden_layers = 2
    cfg.rollout.max_new_tokens = 6
    cfg.algorithm.micro_batch_size = micro_batch
    cfg.algorithm.kl_coef = kl_coef
    return cfg


def make_learner(cfg: ReasoningConfig, gpus: tuple = ()):
    """A ``ReasoningLearner`` in this process (``gpus``: the GPU ids it is given)."""
    from m2flow.reasoning.learner_worker import ReasoningLearner

    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, gpus), "local")
    return ReasoningLearner(info, cfg)
