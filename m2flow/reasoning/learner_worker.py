"""The learner worker: GRPO steps on scored groups, micro-batch by micro-batch as they arrive."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.pipelines import Channel, Worker
from m2flow.reasoning.batch import collate, sequences
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.data import make_datasets
from m2flow.reasoning.grpo import completion_advantages, token_loss
from m2flow.reasoning.model import load_model, resolve_dtype, sequence_logprobs
from m2flow.runs import seeding
from m2flow.runs.learner import Trainer
from m2flow.runs.weights import SendsWeights, WeightSender

WARM_START_MAX_GRAD_NORM = 1.0
WARM_START_WARMUP_STEPS = 20
PRECISION_OF_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # anything else: fp32


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside it (dicts, lists and tuples are
    walked and rebuilt; anything else is kept as it is).

    >>> map_tensors({"state": {0: {"exp_avg": torch.ones(2)}}, "lr": [1e-3, (torch.zeros(1),)]},
    ...             lambda t: t + 1)
    {'state': {0: {'exp_avg': tensor([2., 2.])}}, 'lr': [0.001, (tensor([1.]),)]}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a detached CPU copy (a new one even when it is
    on the CPU already, so the result does not change as training goes on)."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


class ReasoningLearner(SendsWeights, Worker):
    """Owns the trained model, its ``Trainer`` (AdamW, fp32 masters, autocast in the dtype of
    ``model.dtype``) and (with a KL term) a frozen reference copy in ``model.dtype``."""

    def __init__(self, info, cfg: ReasoningConfig):
        super().__init__(info)
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_model(cfg.model, self.device)
        a = cfg.algorithm
        self.ref = None
        modules = {"model": self.model}
        if a.kl_coef > 0:  # copied before the Trainer makes fp32 masters: it stays in model.dtype
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            modules["reference"] = self.ref
        precision = PRECISION_OF_DTYPE.get(resolve_dtype(cfg.model.dtype, self.device), "fp32")
        self.trainer = Trainer(
            self.model, lambda params: torch.optim.AdamW(params, lr=a.learning_rate,
                                                         weight_decay=a.weight_decay),
            precision=precision, max_grad_norm=a.max_grad_norm,
        )
        self.weights = WeightSender(self.model)  # what the rollout's engine was sent
        self.context.register(modules=modules, optimizers={"adamw": self.trainer.optimizer})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    # -- weights -----------------------------------------------------------------------------
    def get_weights(self) -> dict:
        """CPU copies of the weights (fp32 masters), all at once: for checkpoints. The rollout
        gets them bucket by bucket (``SendsWeights.send_weights``)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        """Weights, AdamW state and (with a KL term) the reference, as CPU copies: the driver
        that saves them may have no GPU, and a checkpoint must not alias live tensors."""
        state = {"model": self.get_weights(), "optimizer": cpu_copy(self.optimizer.state_dict())}
        if self.ref is not None:
            state["reference"] = cpu_copy(self.ref.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        """The inverse of :meth:`state_dict`. ``Optimizer.load_state_dict`` moves the AdamW
        state onto each parameter's device and dtype itself (``step`` stays where it was, as
        torch keeps it for non-fused AdamW). A checkpoint without a reference (written before
        references were saved) falls back to its weights."""
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.ref is not None:
            self.ref.load_state_dict(state.get("reference", state["model"]))
        self.weights.reset()  # the rollout's engine gets all of the loaded weights

    # -- supervised warm start ---------------------------------------------------------------
    def warm_start(self, *, steps: int) -> dict:
        """``steps`` of next-token training on the training set's worked solutions (prompt
        tokens masked out); its own AdamW, so GRPO's optimiser starts fresh. The reference
        model (KL) becomes the warmed-up model."""
        cfg, ws = self.cfg, self.cfg.warm_start
        train, _ = make_datasets(cfg.data, cfg.seed)
        train = [p for p in train if p.solution is not None]
        if not train:
            raise ValueError("warm_start.steps > 0 needs worked solutions, which only "
                             "data.source=arithmetic has; set warm_start.steps=0.")
        warm = Trainer(self.model, lambda params: torch.optim.AdamW(params, lr=ws.learning_rate),
                       precision=self.trainer.precision, max_grad_norm=WARM_START_MAX_GRAD_NORM)
        g = torch.Generator().manual_seed(seeding.derive(cfg.seed, seeding.LEARN, 0, 1)[0])
        losses = []
        self.model.train()
        warm.zero_grad()
        with self.timer("warm_start"):
            for s in range(steps):
                idx = torch.randint(len(train), (ws.batch_size,), generator=g).tolist()
                batch = self._sft_batch([train[i] for i in idx])
                ids, mask, start = sequences(batch)
                warm.set_lr(ws.learning_rate * min(1.0, (s + 1) / WARM_START_WARMUP_STEPS)
                            * (1 - s / steps))
                with warm.autocast():
                    lp = sequence_logprobs(self.model, ids.to(self.device), mask.to(self.device),
                                           start)
                    m = batch[keys.COMPLETION_MASK].to(self.device).float()
                    loss = -(lp * m).sum() / m.sum()
                warm.backward(loss)
                warm.step()
                losses.append(loss.item())
        self.model.zero_grad(set_to_none=True)
        if self.ref is not None:
            self.ref.load_state_dict(self.model.state_dict())
        return {"warm_start/loss_first": losses[0], "warm_start/loss_last": losses[-1],
                "warm_start/steps": float(steps)}

    def _sft_batch(self, problems) -> TensorDict:
        tok, template = self.tokenizer, self.cfg.data.template
        enc = tok([p.prompt(template) for p in problems], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        c = self.cfg.rollout.max_new_tokens
        comp = torch.full((len(problems), c), tok.pad_token_id, dtype=torch.long)
        for i, p in enumerate(problems):
            t = tok(p.solution, add_special_tokens=False)["input_ids"][: c - 1] + [tok.eos_token_id]
            comp[i, : len(t)] = torch.tensor(t)
        from m2flow.reasoning.engine import completion_mask

        return TensorDict({keys.PROMPT_IDS: enc["input_ids"],
                           keys.PROMPT_MASK: enc["attention_mask"].bool(),
                           keys.COMPLETION_IDS: comp,
                           keys.COMPLETION_MASK: completion_mask(comp, tok.eos_token_id)},
                          batch_size=[len(problems)])

    # -- GRPO --------------------------------------------------------------------------------
    def update(self, in_ch: Channel, *, num_groups: int, iteration: int) -> dict:
        """One GRPO step over ``num_groups`` scored groups read from ``in_ch`` as they come.

        A micro-batch runs forward and backward as soon as ``micro_batch_size`` completions
        of kept groups are in; gradients accumulate as token sums and are divided by the
        step's token count before the optimiser step.
        """
        a, timeout = self.cfg.algorithm, self.cfg.runner.channel_timeout_s
        self.model.train()
        self.trainer.zero_grad()
        pending: list[TensorDict] = []
        sums = {"tokens": 0.0, "loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "kl_ref": 0.0}
        kept = staleness = 0
        for _ in range(num_groups):
            with self.timer("wait"):
                group = in_ch.get(key=0, timeout=timeout)
            staleness = max(staleness, iteration - int(group[keys.POLICY_VERSION].min()))
            r = group[keys.COMPLETION_REWARD].float()
            if a.filter_groups and bool((r == r[0]).all()):
                continue
            kept += 1
            group[keys.ADVANTAGE] = completion_advantages(r, a.eps)
            pending.append(group)
            if sum(g.batch_size[0] for g in pending) >= a.micro_batch_size:
                self._micro_batch(pending, sums)
                pending = []
        if pending:
            self._micro_batch(pending, sums)
        with self.timer("learn"):
            grad_norm = 0.0
            if sums["tokens"] > 0:  # the token-level mean: sums / the step's token count
                grad_norm = self.trainer.step(grad_divisor=sums["tokens"])
            self.trainer.zero_grad()
        n = max(sums["tokens"], 1.0)
        out = {"loss/policy": sums["loss"] / n, "loss/clip_fraction": sums["clip_fraction"] / n,
               "loss/approx_kl": sums["approx_kl"] / n, "loss/grad_norm": grad_norm,
               "train/groups_kept": float(kept), "train/tokens_trained": sums["tokens"],
               "train/staleness": float(staleness)}
        if self.ref is not None:
            out["loss/kl_ref"] = sums["kl_ref"] / n
        return out

    def _micro_batch(self, groups: list[TensorDict], sums: dict) -> None:
        a = self.cfg.algorithm
        with self.timer("learn"):
            batch = collate(groups, self.tokenizer.pad_token_id).to(self.device)
            ids, mask, start = sequences(batch)
            temp = self.cfg.rollout.temperature
            with self.trainer.autocast():
                logp = sequence_logprobs(self.model, ids, mask, start, temp)
                ref = None
                if self.ref is not None:
                    with torch.no_grad():
                        ref = sequence_logprobs(self.ref, ids, mask, start, temp)
                cmask = batch[keys.COMPLETION_MASK]
                loss, stats = token_loss(logp, batch[keys.LOGPROBS], batch[keys.ADVANTAGE],
                                         cmask, a.clip_coef, ref, a.kl_coef)
            self.trainer.backward(loss)  # a token sum: divided by the step's count in update
            sums["tokens"] += float(cmask.sum())
            sums["loss"] += loss.item()
            for k, v in stats.items():
                sums[k] += float(v)
