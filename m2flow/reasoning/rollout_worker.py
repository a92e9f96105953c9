"""The rollout worker: samples ``n`` completions per prompt and streams each group on."""

from __future__ import annotations

from typing import Optional

import time

import torch

from m2flow import keys
from m2flow.runs import seeding
from m2flow.pipelines import Channel, Worker
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.data import make_datasets
from m2flow.reasoning.engine import make_engine
from m2flow.reasoning.model import load_model
from m2flow.reasoning.reward import reward_fn
from m2flow.runs.weights import ReceivesWeights, WeightReceiver


class ReasoningRollout(ReceivesWeights, Worker):
    """Holds the generation engine and the prompts; knows which prompts each step uses."""

    def __init__(self, info, cfg: ReasoningConfig):
        super().__init__(info)
        self.cfg = cfg
        torch.manual_seed(cfg.seed)  # the same initial weights as the learner's
        self.model, self.tokenizer = load_model(cfg.model, self.device)
        self.engine = make_engine(self.model, self.tokenizer, cfg.rollout, self.device)
        self.train, self.test = make_datasets(cfg.data, cfg.seed)
        self.version = 0
        self._perm: tuple[int, list[int]] = (-1, [])
        self.context.register(modules={"model": self.model},
                              caches={"kv_cache": self.engine.release_cache})

    # -- weights, bucket by bucket (ReceivesWeights): nothing generates while weights arrive
    # (the runner syncs between steps), so each bucket loads as it arrives and host memory
    # holds one bucket at a time; the groups generated next carry the new version
    def weight_receiver(self) -> WeightReceiver:
        return self.engine.weight_receiver()

    def problems_of_step(self, step: int) -> list[int]:
        """Indices of the training problems of ``step``: epochs of seeded permutations."""
        k, n = self.cfg.algorithm.prompts_per_step, len(self.train)
        out = []
        for i in range(step * k, (step + 1) * k):
            epoch, j = divmod(i, n)
            if self._perm[0] != epoch:
                g = torch.Generator().manual_seed(
                    seeding.derive(self.cfg.seed, seeding.TRAIN, epoch, 0)[0])
                self._perm = (epoch, torch.randperm(n, generator=g).tolist())
            out.append(self._perm[1][j])
        return out

    def generate_step(self, out_ch: Channel, *, iteration: int) -> dict:
        """Generates the step's groups call by call; each group goes to ``out_ch`` (key 0) as
        soon as its call returns, tagged with its problem index and the weights' version."""
        cfg = self.cfg.rollout
        problems = self.problems_of_step(iteration)
        tokens, t0 = 0, time.perf_counter()
        for c in range(0, len(problems), cfg.prompts_per_call):
            idx = problems[c : c + cfg.prompts_per_call]
            prompts = [self.train[i].prompt(self.cfg.data.template) for i in idx]
            seed = seeding.derive(self.cfg.seed, seeding.SAMPLE, iteration, c)[0]
            with self.timer("generate"):
                out = self.engine.generate(prompts, cfg.n, seed=seed)
            tokens += int(out[keys.COMPLETION_MASK].sum())
            for g, i in enumerate(idx):
                group = out[g * cfg.n : (g + 1) * cfg.n].clone()  # own storage: a view
                # would pickle the whole call's tensors into every group's message
                group[keys.PROBLEM] = torch.full((cfg.n,), i, dtype=torch.long)
                group[keys.POLICY_VERSION] = torch.full((cfg.n,), self.version, dtype=torch.long)
                with self.timer("send"):
                    out_ch.put(group, key=0, timeout=self.cfg.runner.channel_timeout_s)
        out_ch.flush()
        seconds = time.perf_counter() - t0
        return {"perf/gen_tokens": float(tokens), "perf/gen_s": seconds}

    def num_eval_problems(self, *, size: int = 0) -> int:
        """How many held-out problems ``eval_accuracy(size=size)`` scores."""
        return len(self.test[: size or None])

    def eval_accuracy(self, *, size: int = 0, samples: int = 0, start: int = 0,
                      stop: Optional[int] = None) -> dict:
        """Greedy held-out accuracy of problems ``[start, stop)`` of the first ``size`` (0:
        all): {"accuracy", "response_len", "problems", "samples": [...]}. The runner asks for
        slices, to show progress between them."""
        problems = self.test[: size or None][start:stop]
        return evaluate_problems(self.engine, self.tokenizer, problems, self.cfg, samples)


def evaluate_problems(engine, tokenizer, problems, cfg: ReasoningConfig, samples: int = 0) -> dict:
    """Greedy decoding of every problem, scored with the run's reward function."""
    score = reward_fn(cfg.algorithm.reward)
    correct, lengths, shown = [], [], []
    bs = cfg.rollout.eval_batch_size
    for c in range(0, len(problems), bs):
        batch = problems[c : c + bs]
        out = engine.generate([p.prompt(cfg.data.template) for p in batch], 1, greedy=True)
        texts = decode(tokenizer, out)
        for p, text, n in zip(batch, texts, out[keys.COMPLETION_MASK].sum(-1).tolist()):
            ok = score(text, p.answer)
            correct.append(ok)
            lengths.append(n)
            if len(shown) < samples:
                shown.append({"question": p.question, "answer": p.answer, "completion": text,
                              "correct": bool(ok)})
    n = max(1, len(correct))
    return {"accuracy": sum(correct) / n, "response_len": sum(lengths) / n,
            "problems": len(correct), "samples": shown}


def decode(tokenizer, batch) -> list[str]:
    """Completion texts, without EOS and padding."""
    ids, mask = batch[keys.COMPLETION_IDS], batch[keys.COMPLETION_MASK]
    return [tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask)]
