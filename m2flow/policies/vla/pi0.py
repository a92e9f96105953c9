"""π0 / π0.5-style flow-matching VLA (``policy.name=pi0``): openpi's network
(:mod:`.pi0_model`) acting through the denoising chain every flow policy shares
(:mod:`m2flow.policies.flow_chain`: Euler sampling, Flow-SDE / Flow-Noise log-probs for PPO and
GRPO, flow-matching BC).

Per env the prefix is openpi's: each image of ``image_keys`` (uint8 -> [-1, 1], resized to the
tower's resolution) through SigLIP and the projector, then the prompt tokens (embeddings times
√width), all one bidirectional block with the prompt's padding masked out. The suffix is
π0's state token (the running-normalised state, zero-padded to ``action_dim``, through
``state_proj``) and the H action tokens (the noisy chunk, zero-padded to ``action_dim``,
through ``action_in_proj`` and the action-time MLP with the time's sinusoidal features), or
π0.5's action tokens alone with the time in the expert's adaRMS norms; ``variant`` switches
the two. The velocity is ``action_out_proj`` of the last H expert outputs, its first A dims.

The prompt is openpi's: π0 ``<bos>`` + the task (``_`` and newlines made spaces) + newline;
π0.5 ``<bos>`` + ``Task: {task}, State: {s_1 s_2 ...};\\nAction: ``, the state discretised
into 256 bins over [-1, 1] as openpi's tokenizer does (here the running-normalised state
divided by ``STATE_TEXT_STDS`` and clipped, openpi's quantile normalisation standing in).

The prefix's keys and values are computed once per observation and reused by each denoising
step (the prefix never attends the suffix, so this equals the joint pass); behaviour cloning
runs the joint pass itself, prefix and suffix in one sequence, as openpi trains.

Value: ``critic=head`` (default) is an MLP on the prefix's final hidden states mean-pooled over
its valid tokens, as RLinf's πRL critic with ``value_after_vlm`` and ``value_vlm_mode:
mean_token`` (its π0.5 setting): it depends on the observation only. RLinf's other critic
averages the expert's outputs during denoising, which depend on the chain's noise, so the
value of one observation would change from call to call. ``critic=privileged``: an MLP over
the simulator state (:mod:`m2flow.policies.critics`).

``policy.checkpoint=<dir>`` (:mod:`.pi0_checkpoint`): openpi's converted PyTorch
``model.safetensors`` (names and shapes: ``tests/policies/data/pi0_names.txt``,
``pi05_names.txt``) is loaded at ``size=full`` (PaliGemma 3B: SigLIP So400m/14 at 224 px,
Gemma 2B; expert Gemma 300M) with ``policy.tokenizer`` (PaliGemma's tokenizer files). openpi's
normalisation statistics (``assets/*/norm_stats.json``) are not read: state and actions use
m2flow's normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from m2flow import keys
from m2flow.policies import critics, flow_chain, hidden_state
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.policies.flow_chain import FlowChain, FlowChainSettings
from m2flow.policies.layers import CRITIC_OUT_GAIN, mlp
from m2flow.policies.normalizer import RunningNorm, state_norm
from m2flow.policies.vla import pi0_checkpoint
from m2flow.policies.vla import pi0_model as pm
from m2flow.policies.vla.oft_config import check_wrist_camera, weights_dtype
from m2flow.registry import Requires

VARIANTS = ("pi0", "pi05")
SIZES = ("tiny", "full")
CRITICS = ("head", critics.PRIVILEGED)
PIXEL_MAX = 255.0
STATE_BINS = 256  # openpi's π0.5 state discretisation
STATE_TEXT_STDS = 3.0  # running stds mapped onto [-1, 1] before it
PRIVILEGED_HIDDEN = [256, 256]
PROPRIO_HIDDEN = "policy.proprio_hidden"


@dataclass
class Pi0PolicyConfig(PolicyConfig, FlowChainSettings):
    """``policy.name=pi0``: the network (tiny and random, or openpi's published checkpoint),
    its time conditioning, the chain, the critic and what trains."""

    variant: str = "pi0"
    """'pi0': state token + action-time MLP; 'pi05': adaRMS time conditioning in the expert,
    the state as text in the prompt."""
    image_keys: List[str] = field(default_factory=lambda: ["rgb", "wrist_rgb"])
    """Image observations to read, in this order (those the env has)."""
    action_dim: int = 32
    """The model's action and state width (openpi's: 32); env actions and states are
    zero-padded to it."""
    size: str = "tiny"
    """'tiny': the sizes below; 'full': openpi's (SigLIP So400m/14 at 224, Gemma 2B, expert
    Gemma 300M, vocabulary 257152)."""
    image_size: int = 64
    """tiny: the vision tower's resolution (frames are resized to it)."""
    patch_size: int = 8
    """tiny: SigLIP's patch size."""
    vision_width: int = 64
    """tiny: SigLIP's width."""
    vision_depth: int = 2
    """tiny: SigLIP's layers."""
    vision_heads: int = 2
    """tiny: SigLIP's heads."""
    vision_mlp: int = 128
    """tiny: SigLIP's MLP width."""
    prefix_width: int = 128
    """tiny: the prefix Gemma's width."""
    prefix_mlp: int = 256
    """tiny: the prefix Gemma's MLP width."""
    expert_width: int = 64
    """tiny: the action expert's width."""
    expert_mlp: int = 128
    """tiny: the action expert's MLP width."""
    depth: int = 2
    """tiny: layers of both Gemmas (joint attention pairs them)."""
    num_heads: int = 2
    """tiny: attention heads of both Gemmas."""
    num_kv_heads: int = 1
    """tiny: key-value heads of both Gemmas (Gemma 2B's: 1)."""
    head_dim: int = 64
    """tiny: width of one head of both Gemmas."""
    text_vocab: int = 512
    """tiny: size of the locally built byte-level BPE (:mod:`.text`)."""
    normalize_obs: bool = True
    """Normalise the state by running mean/std (updated by the learner)."""
    hold_obs_norm: bool = False
    """Keep those statistics as they start (a warm start's: ``init_from``); as the MLP
    policies' field of the same name."""
    proprio_hidden: List[List[int]] = field(default_factory=list)
    """[start, end) ranges of the state's dims the policy reads as 0 (after normalisation), in
    π0's state token and π0.5's state text; e.g. [[9, 18]] hides ManiSkill Panda's joint
    velocities, which a cloned policy copies (:mod:`m2flow.policies.hidden_state`)."""
    critic: str = "head"
    """'head': an MLP on the pooled prefix; 'privileged': an MLP over the simulator state."""
    value_hidden: List[int] = field(default_factory=lambda: [128])
    """Hidden widths of the value head."""
    state_aux: float = 0.0
    """> 0: an auxiliary loss in training, this coefficient x the mean squared error of a
    linear head predicting the running-normalised simulator state (``("obs", "privileged")``,
    env.privileged_state=true; a demos file recorded with it) from the prefix's final hidden
    states mean-pooled over its valid tokens (where ``critic=head`` reads; the action expert
    attends every prefix token). A tower and prefix built from random weights then learn
    where the objects are from a dense, supervised signal (with BC's
    ``algorithm.aux_pretrain_iterations``: before cloning); acting never calls the head.
    0: off."""
    checkpoint: Optional[str] = None
    """A local directory with openpi's converted ``model.safetensors`` (of this ``variant``);
    its weights replace the random ones."""
    tokenizer: Optional[str] = None
    """With ``size=full``: a local directory of PaliGemma's tokenizer files."""
    lora_rank: int = 0
    """> 0: LoRA adapters (peft, fp32) of this rank on both Gemmas' projections; the rest of
    the PaliGemma and the expert is frozen in ``dtype``; projections and heads train."""
    lora_alpha: int = 16
    """LoRA's scale numerator (adapters scaled by lora_alpha / lora_rank)."""
    dtype: str = "auto"
    """'float32', 'bfloat16', or 'auto' (bfloat16 on CUDA) for the PaliGemma and the expert;
    projections and heads stay fp32."""


def _check(o: Pi0PolicyConfig) -> None:
    """PolicyError naming the field for settings that cannot work (files: at build)."""
    flow_chain.check_settings(o)
    choices = {"variant": VARIANTS, "size": SIZES, "critic": CRITICS,
               "dtype": ("auto", "float32", "bfloat16")}
    for name, allowed in choices.items():
        if getattr(o, name) not in allowed:
            raise PolicyError(f"policy.{name}={getattr(o, name)!r}: use one of {list(allowed)}.")
    sizes = ("action_dim", "image_size", "patch_size", "vision_width", "vision_depth",
             "vision_heads", "vision_mlp", "prefix_width", "prefix_mlp", "expert_width",
             "expert_mlp", "depth", "num_heads", "num_kv_heads", "head_dim", "text_vocab")
    for name in sizes:
        if getattr(o, name) < 1:
            raise PolicyError(f"policy.{name}={getattr(o, name)}: must be >= 1.")
    if o.num_heads % o.num_kv_heads:
        raise PolicyError(f"policy.num_heads={o.num_heads}: must be a multiple of "
                          f"policy.num_kv_heads={o.num_kv_heads}.")
    if o.vision_width % o.vision_heads or o.image_size % o.patch_size:
        raise PolicyError("policy.vision_width must be a multiple of policy.vision_heads and "
                          "policy.image_size of policy.patch_size.")
    if o.lora_rank < 0:
        raise PolicyError(f"policy.lora_rank={o.lora_rank}: must be >= 0 (0: no LoRA).")
    hidden_state.ranges(o.proprio_hidden, None, PROPRIO_HIDDEN)
    critics.StateAux.check(o.state_aux)
    if o.size == "full" and not o.tokenizer:
        raise PolicyError("policy.size=full needs policy.tokenizer: a local directory of "
                          "PaliGemma's tokenizer files (the tiny tokenizer's ids mean nothing "
                          "to its embeddings).")
    if o.checkpoint is not None:
        pi0_checkpoint.check_path(o.checkpoint)


@dataclass
class Prefix:
    """One observation batch's prefix, the context of the velocity: its token embeddings and
    valid mask, the padded state, and (once run alone) each layer's keys and values and the
    pooled final hidden state."""

    embeds: torch.Tensor  # (B, Lp, Wp)
    valid: torch.Tensor  # (B, Lp) bool
    state: torch.Tensor  # (B, action_dim)
    kv: Optional[list] = None  # per layer (k, v): (B, kv_heads, Lp, d)
    pooled: Optional[torch.Tensor] = None  # (B, Wp) fp32


def _pool(hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, Wp) fp32: the prefix's hidden states (B, Lp, Wp) averaged over its valid tokens."""
    w = valid[..., None].float()
    return (hidden.float() * w).sum(1) / w.sum(1).clamp_min(1.0)


class Pi0Policy(FlowChain, Policy):
    """``policy.name=pi0`` (module docstring)."""

    config_class = Pi0PolicyConfig
    requires = Requires(("transformers",), "m2flow[vla]")  # SigLIP, Gemma, PaliGemma
    score_steps_apart = True  # SDPA and matmuls round differently at batch B·K than at B

    @staticmethod
    def check_config(policy_cfg: Pi0PolicyConfig, env_cfg=None) -> None:
        """PolicyError for a state-only env or a bad setting; loads no weights."""
        if env_cfg is not None and env_cfg.obs_mode == "state":
            raise PolicyError(f"policy={policy_cfg.name} reads camera images, but "
                              "env.obs_mode=state renders none; use env.obs_mode=rgb.")
        check_wrist_camera(policy_cfg, env_cfg)
        _check(policy_cfg)
        if policy_cfg.lora_rank > 0:
            Requires(("peft",), "m2flow[vla]").check(f"policy.lora_rank={policy_cfg.lora_rank}",
                                                     PolicyError)
        if policy_cfg.critic == critics.PRIVILEGED and env_cfg is not None:
            critics.check_env(env_cfg, "policy.critic=privileged", "use policy.critic=head")
        critics.StateAux.check(policy_cfg.state_aux, env_cfg)

    def __init__(self, cfg: Pi0PolicyConfig, env_spec, device: str = "cpu"):
        super().__init__()
        _check(cfg)
        self.cfg = o = cfg
        shapes = env_spec.obs_shapes
        self.image_keys = [k for k in o.image_keys if k in shapes]
        if not self.image_keys:
            raise PolicyError(f"policy.name=pi0 reads images {list(o.image_keys)}, but the env "
                              f"observes {sorted(shapes)}; set env.obs_mode=rgb (or "
                              "policy.image_keys).")
        state_dim = shapes["state"][0] if "state" in shapes else 0
        if max(state_dim, env_spec.action_dim) > o.action_dim:
            raise PolicyError(f"policy.action_dim={o.action_dim}: the env's state ({state_dim}) "
                              f"and action ({env_spec.action_dim}) must fit; raise it.")
        self.tokenizer = self._tokenizer(o)
        dtype = weights_dtype(o.dtype, device)
        if o.checkpoint:
            self.model = pi0_checkpoint.load(o, len(self.tokenizer) if o.size == "tiny" else
                                             pm.PALIGEMMA_VOCAB, dtype, device)
        else:
            with torch.device(device):
                self.model = pm.build(o, pm.PALIGEMMA_VOCAB if o.size == "full"
                                      else len(self.tokenizer))
            self.model.paligemma_with_expert.to(dtype)
        self.pwe = self.model.paligemma_with_expert
        self.image_size = self.pwe.paligemma.config.vision_config.image_size
        self.prefix_width = self.pwe.language_model.config.hidden_size
        with torch.device(device):
            self._init_chain(o, env_spec, o.chunk * self.model.action_in_proj.out_features)
            self.obs_norm = state_norm(state_dim, o, bool(state_dim))
            if o.critic == critics.PRIVILEGED:
                self.critic = critics.privileged_critic(env_spec, PRIVILEGED_HIDDEN)
                self.value_head = None
            else:
                self.critic = None
                self.value_head = mlp(self.prefix_width, list(o.value_hidden), 1, "tanh",
                                      CRITIC_OUT_GAIN)
            self.state_aux = critics.StateAux.build(self.prefix_width, shapes, o.state_aux)
        self.state_dim = state_dim
        ranges = hidden_state.ranges(o.proprio_hidden, state_dim, PROPRIO_HIDDEN)
        self.register_buffer(  # a constant of the config: not saved
            "proprio_sees", hidden_state.sees(ranges, state_dim, device=device), persistent=False)
        if o.lora_rank > 0:
            self.pwe.add_lora(o.lora_rank, o.lora_alpha)
        self._set_prompts(env_spec, device)

    @staticmethod
    def _tokenizer(o: Pi0PolicyConfig):
        if o.size == "full":
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(o.tokenizer, local_files_only=True)
        from m2flow.policies.vla.text import tiny_tokenizer

        return tiny_tokenizer(o.text_vocab)

    def _set_prompts(self, env_spec, device) -> None:
        """π0: ``prompt_ids`` (n_tasks, P) right-padded and ``prompt_valid``; π0.5: the tasks'
        cleaned texts (the prompt is made per call, with the state)."""
        self.tasks = [t.strip().replace("_", " ").replace("\n", " ")
                      for t in (list(env_spec.tasks) or [""])]
        ids = [self._encode(f"{t}\n") for t in self.tasks]
        ids_t, valid = self._pad(ids, device)
        self.register_buffer("prompt_ids", ids_t, persistent=False)
        self.register_buffer("prompt_valid", valid, persistent=False)

    def _encode(self, text: str) -> list[int]:
        return [self.tokenizer.bos_token_id] + self.tokenizer(
            text, add_special_tokens=False)["input_ids"]

    def _pad(self, ids: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id or 0  # masked out: any id does
        return (torch.tensor([i + [pad] * (width - len(i)) for i in ids], device=device),
                torch.tensor([[True] * len(i) + [False] * (width - len(i)) for i in ids],
                             device=device))

    # -- the prefix --------------------------------------------------------------------------

    def _state(self, obs: TensorDict, b: int, dev) -> torch.Tensor:
        """The normalised state, 0 in ``proprio_hidden``'s dims, zero-padded to
        ``action_dim`` (B, action_dim)."""
        out = torch.zeros(b, self.cfg.action_dim, device=dev)
        if self.state_dim:
            state = self.obs_norm(obs[keys.leaf(keys.STATE)].float().to(dev))
            out[:, : self.state_dim] = (state if self.proprio_sees is None
                                        else state * self.proprio_sees)
        return out

    def _prompt(self, obs: TensorDict, state: torch.Tensor, b: int, dev):
        """(ids (B, P), valid (B, P)): the task's prompt, π0.5's with the state as text."""
        task = obs.get(keys.leaf(keys.TASK), None)
        task = torch.zeros(b, dtype=torch.long, device=dev) if task is None else task.long().to(dev)
        if self.cfg.variant == "pi0":
            return self.prompt_ids[task], self.prompt_valid[task]
        s = (state[:, : self.state_dim] / STATE_TEXT_STDS).clamp(-1, 1)
        bins = torch.bucketize(s, torch.linspace(-1, 1, STATE_BINS + 1, device=dev)[1:-1])
        texts = [f"Task: {self.tasks[int(k)]}, State: {' '.join(map(str, row))};\nAction: "
                 for k, row in zip(task.tolist(), bins.tolist())]
        return self._pad([self._encode(t) for t in texts], dev)

    def _pixels(self, obs: TensorDict) -> torch.Tensor:
        """(B·n, 3, S, S) in [-1, 1] at the tower's resolution S (SigLIP's normalisation)."""
        images = torch.stack([obs[k] for k in self.image_keys], dim=1)  # (B, n, H, W, 3)
        x = images.flatten(0, 1).permute(0, 3, 1, 2).float() / PIXEL_MAX * 2 - 1
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              antialias=True, align_corners=False)
        return x

    def _prefix(self, obs: TensorDict) -> Prefix:
        """The prefix's embeddings (images, then the prompt) and valid mask, not yet run."""
        pixels = self._pixels(obs)
        dev = self.action_center.device
        b = obs.batch_size[0]
        img = self.pwe.embed_image(pixels.to(dev))  # (B·n, P, Wp)
        img = img.reshape(b, -1, img.shape[-1])
        state = self._state(obs, b, dev)
        ids, valid = self._prompt(obs, state, b, dev)
        text = self.pwe.embed_language_tokens(ids).to(img.dtype)
        embeds = torch.cat([img, text], dim=1)
        valid = torch.cat([torch.ones(img.shape[:2], dtype=torch.bool, device=dev), valid], 1)
        return Prefix(embeds, valid, state)

    def _run_prefix(self, p: Prefix) -> Prefix:
        """The prefix run alone (one bidirectional block): its keys, values and pooled state."""
        allowed = pm.attention_mask(p.valid, torch.zeros_like(p.valid[0], dtype=torch.long))
        positions = (p.valid.long().cumsum(-1) - 1).clamp_min(0)
        (hidden, _), kv = self.pwe(p.embeds, None, allowed, positions, keep_kv=True)
        return Prefix(p.embeds, p.valid, p.state, kv, _pool(hidden, p.valid))

    # -- the velocity --------------------------------------------------------------------------

    def _suffix(self, ctx: Prefix, x: torch.Tensor, t: torch.Tensor):
        """(tokens, joint mask (B, Lp+Ls, Lp+Ls), positions (B, Lp+Ls), adaRMS conditioning)
        of the noisy chunk x (N, H, A) zero-padded to ``action_dim``."""
        xs = F.pad(x, (0, self.cfg.action_dim - x.shape[-1]))
        tokens, ar_suffix, cond = self.model.embed_suffix(ctx.state, xs, t)
        b, ls = tokens.shape[:2]
        valid = torch.cat([ctx.valid, torch.ones(b, ls, dtype=torch.bool, device=x.device)], 1)
        ar = torch.cat([torch.zeros(ctx.valid.shape[1], dtype=torch.long, device=x.device),
                        ar_suffix])
        allowed = pm.attention_mask(valid, ar)
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        return tokens, allowed, positions, cond

    def _velocity(self, ctx: Prefix, x: torch.Tensor,
                  t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v (N, H, A), features (N, H·We)): the expert's last H outputs through
        ``action_out_proj``. With the prefix's keys and values cached, only the suffix runs;
        else the joint pass of prefix and suffix (openpi's training forward)."""
        tokens, allowed, positions, cond = self._suffix(ctx, x, t)
        lp = ctx.valid.shape[1]
        dtype = ctx.embeds.dtype
        if ctx.kv is None:
            (hidden, out), _ = self.pwe(ctx.embeds, tokens.to(dtype), allowed, positions, cond)
            ctx.pooled = _pool(hidden, ctx.valid)  # the prefix never attends the suffix
        else:
            (_, out), _ = self.pwe(None, tokens.to(dtype), allowed[:, lp:], positions[:, lp:],
                                   cond, past=ctx.kv)
        out = out[:, -x.shape[1]:].float()  # (N, H, We)
        v = self.model.action_out_proj(out)[..., : x.shape[-1]]
        return v, out.flatten(1)

    # -- Policy ------------------------------------------------------------------------------

    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        """``action`` (B, H, A) in env units, ``flow_chain``, (``flow_step``), ``log_prob``,
        ``token_log_prob`` (B, H·A), ``value`` (B,)."""
        obs = batch[keys.OBS]
        ctx = self._run_prefix(self._prefix(obs))
        b = obs.batch_size[0]
        out = self._act_outputs(ctx, b, self.action_center.device, deterministic, obs)
        out[keys.VALUE] = self._value(obs, ctx)
        return TensorDict(out, batch_size=batch.batch_size)

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        """The stored chain's log-probs with gradients (:class:`FlowChain`), and ``value``."""
        obs = batch[keys.OBS]
        ctx = self._run_prefix(self._prefix(obs))
        out = self._chain_log_probs(ctx, batch)
        out[keys.VALUE] = self._value(obs, ctx)
        if self.state_aux is not None:
            out[keys.AUX_LOSS] = self.state_aux.loss(obs, ctx.pooled)
        return TensorDict(out, batch_size=batch.batch_size)

    def bc_loss(self, batch: TensorDict, eps: Optional[torch.Tensor] = None,
                t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flow matching (per sample) on expert chunks ``action``, through the joint pass
        (PPO's demo term: the auxiliary head is left out)."""
        return self._flow_matching_loss(self._prefix(batch[keys.OBS]), batch[keys.ACTION],
                                        eps, t)

    def bc_losses(self, batch: TensorDict, eps: Optional[torch.Tensor] = None,
                  t: Optional[torch.Tensor] = None):
        """(flow matching, ``policy.state_aux``'s loss or None), per sample, from one joint
        pass: the auxiliary head reads the pass's pooled prefix."""
        obs = batch[keys.OBS]
        ctx = self._prefix(obs)
        fm = self._flow_matching_loss(ctx, batch[keys.ACTION], eps, t)
        aux = None if self.state_aux is None else self.state_aux.loss(obs, ctx.pooled)
        return fm, aux

    def _value(self, obs: TensorDict, ctx: Prefix) -> torch.Tensor:
        if self.critic is not None:
            return self.critic(obs)
        return self.value_head(ctx.pooled).squeeze(-1)

    def value(self, obs: TensorDict) -> torch.Tensor:
        if self.critic is not None:  # no VLM forward for it
            return self.critic(obs)
        return self._value(obs, self._run_prefix(self._prefix(obs)))

    def observe(self, batch: TensorDict) -> None:
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(batch[keys.STATE].float())
        if self.critic is not None:
            self.critic.observe(batch)
        if self.state_aux is not None:
            self.state_aux.observe(batch)
