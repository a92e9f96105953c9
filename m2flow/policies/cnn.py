"""Gaussian CNN actor-critic for image observations (ManiSkill3 PPO rgb baseline shape).

Reads ``("obs", "rgb")`` (B, H, W, C) uint8 and, when the env has it, ``("obs", "state")``
(B, D). One encoder, shared by actor and critic: the NatureCNN over the image scaled to [0, 1]
(or, with ``policy.encoder=timm/<model>``, a randomly initialised timm backbone), with the
(normalised) state concatenated to its features. Heads as in ``mlp.py``: an actor MLP
-> action mean with a learned state-independent log-std, and a critic MLP -> value.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from m2flow import keys
from m2flow.policies import critics, hidden_state, task_embedding
from m2flow.policies.base import PolicyError
from m2flow.policies.layers import ACTIVATIONS, orthogonal_linear
from m2flow.policies.mlp import HIDE_FIELD, GaussianActorCritic, GaussianConfig, check_critic
from m2flow.policies.normalizer import RunningNorm, state_norm
from m2flow.registry import Requires

# The unpadded convs need this many pixels per side to leave a 1x1 map; smaller images are
# zero-padded up to it rather than refused.
MIN_IMAGE_SIZE = 36
CONV_GAIN = np.sqrt(2)  # ReLU gain, as orthogonal_linear uses for hidden layers
PIXEL_MAX = 255.0
NATURE_ENCODER = "nature"
TIMM_PREFIX = "timm/"
TIMM_EXAMPLE = "timm/resnet18"
PRIVILEGED_CRITIC = critics.PRIVILEGED


@dataclass
class CNNPolicyConfig(GaussianConfig):
    """``policy.name=cnn``: the Gaussian actor-critic's settings and the image encoder's.
    ``critic=shared`` is ManiSkill's rgb baseline (the critic reads the encoder's features);
    with ``privileged`` the encoder learns from the actor's loss alone."""

    feature_dim: int = 256
    """Width of the image features (the encoder's final linear layer)."""
    encoder: str = NATURE_ENCODER
    """Image encoder: 'nature' (NatureCNN) or 'timm/<model>', e.g. 'timm/resnet18' (random init)."""
    encoder_weights: Optional[str] = None
    """Local file of a state_dict (torch.save) for the timm backbone, loaded strictly; or None."""
    state_aux: float = 0.0
    """> 0: an auxiliary loss, this coefficient x the mean squared error of a linear head that
    predicts the normalised ``("obs", "privileged")`` simulator state from the actor's features
    (``env.privileged_state=true``): the encoder learns where cube and goal are from a dense
    supervised signal. Training only; the actor reads what it read before. 0: off."""


def _check(cfg: CNNPolicyConfig) -> None:
    """PolicyError for a critic, encoder or auxiliary loss that cannot be built."""
    is_timm = cfg.encoder.startswith(TIMM_PREFIX)
    if cfg.encoder != NATURE_ENCODER and not is_timm:
        raise PolicyError(
            f"policy.encoder={cfg.encoder!r}: use {NATURE_ENCODER!r} or "
            f"'{TIMM_PREFIX}<model>', e.g. {TIMM_EXAMPLE!r}."
        )
    if is_timm:
        Requires(("timm",), "m2flow[vla]").check(f"policy.encoder={cfg.encoder!r}", PolicyError)
    check_critic(cfg.critic)
    if cfg.feature_dim < 1:
        raise PolicyError(f"policy.feature_dim={cfg.feature_dim}: must be >= 1.")
    critics.StateAux.check(cfg.state_aux)
    if cfg.encoder_weights is not None and not is_timm:
        raise PolicyError(
            "policy.encoder_weights loads a timm backbone; set policy.encoder to "
            f"'{TIMM_PREFIX}<model>' (e.g. {TIMM_EXAMPLE!r}) or drop encoder_weights."
        )
    if cfg.encoder_weights is not None and not os.path.isfile(cfg.encoder_weights):
        raise PolicyError(
            f"policy.encoder_weights={cfg.encoder_weights!r}: no such file. Give the path "
            "of a state_dict saved with torch.save for that timm model, or null for random init."
        )


def _conv(n_in: int, n_out: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(n_in, n_out, kernel, stride)
    nn.init.orthogonal_(conv.weight, CONV_GAIN)
    nn.init.zeros_(conv.bias)
    return conv


class NatureCNN(nn.Module):
    """uint8 images (..., H, W, C) -> features (..., feature_dim), for any image size."""

    def __init__(self, image_shape: tuple[int, int, int], feature_dim: int):
        super().__init__()
        h, w, c = image_shape
        pad_h, pad_w = max(0, MIN_IMAGE_SIZE - h), max(0, MIN_IMAGE_SIZE - w)
        self.pad = (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
        self.convs = nn.Sequential(
            _conv(c, 32, 8, 4), nn.ReLU(),
            _conv(32, 64, 4, 2), nn.ReLU(),
            _conv(64, 64, 3, 1), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():  # the flatten size depends on the image size
            n_flat = self.convs(self._to_float(torch.zeros(1, h, w, c, dtype=torch.uint8))).shape[1]
        self.fc = nn.Sequential(orthogonal_linear(n_flat, feature_dim), nn.ReLU())

    def _to_float(self, rgb: torch.Tensor) -> torch.Tensor:
        x = rgb.permute(0, 3, 1, 2).float() / PIXEL_MAX  # (B, C, H, W) in [0, 1]
        return F.pad(x, self.pad) if any(self.pad) else x

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        lead = rgb.shape[:-3]
        x = self._to_float(rgb.reshape(-1, *rgb.shape[-3:]))  # (B, C, H, W)
        return self.fc(self.convs(x)).reshape(*lead, -1)  # (..., feature_dim)


def _timm_backbone(model_name: str, in_chans: int) -> nn.Module:
    """A randomly initialised timm model whose output is its pooled features (no hub download)."""
    import timm  # lazy: timm imports torchvision, which only this encoder needs

    known = timm.list_models()
    if model_name.split(".")[0] not in known:  # a '.tag' suffix names pretrained weights only
        close = difflib.get_close_matches(model_name, known, n=3)
        hint = f" Did you mean {', '.join(repr(TIMM_PREFIX + m) for m in close)}?" if close else ""
        raise PolicyError(
            f"policy.encoder='{TIMM_PREFIX}{model_name}': timm has no model "
            f"{model_name!r}.{hint} Use '{TIMM_PREFIX}<model>' with a name from "
            f"timm.list_models(), e.g. {TIMM_EXAMPLE!r}."
        )
    return timm.create_model(model_name, pretrained=False, num_classes=0, in_chans=in_chans)


class TimmEncoder(nn.Module):
    """uint8 images (..., H, W, C) -> features (..., feature_dim) through a timm backbone.

    Pixels go to [0, 1], then are normalised by the model's pretrained mean/std (when it has
    them for C channels), channels-first; the backbone's pooled features (``num_features``)
    pass through Linear -> feature_dim + ReLU, as in the NatureCNN head.
    """

    def __init__(self, image_shape: tuple[int, int, int], feature_dim: int, model_name: str,
                 weights: str | None = None):
        super().__init__()
        h, w, c = image_shape
        self.backbone = _timm_backbone(model_name, c)
        if weights is not None:
            self._load(weights, model_name)
        cfg = getattr(self.backbone, "pretrained_cfg", None) or {}
        mean, std = cfg.get("mean"), cfg.get("std")
        if mean is None or std is None or len(mean) != c or len(std) != c:
            mean, std = (0.0,) * c, (1.0,) * c  # no statistics for these channels: [0, 1] as is
        # Not persistent: they come from the model name, so checkpoints hold only weights.
        self.register_buffer("mean", torch.tensor(mean).view(1, c, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, c, 1, 1), persistent=False)
        self._check_image_size(h, w, c, model_name)
        self.fc = nn.Sequential(orthogonal_linear(self.backbone.num_features, feature_dim), nn.ReLU())

    def _load(self, path: str, model_name: str) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.backbone.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise PolicyError(
                f"policy.encoder_weights={path!r} does not match timm model "
                f"{model_name!r}: {e}\nSave backbone.state_dict() of that same model."
            ) from e

    @torch.no_grad()
    def _check_image_size(self, h: int, w: int, c: int, model_name: str) -> None:
        # Fail at startup, not at the first rollout; eval() so BatchNorm stats stay untouched.
        self.backbone.eval()
        try:
            self.backbone(torch.zeros(1, c, h, w))
        except (RuntimeError, AssertionError, ValueError) as e:
            raise PolicyError(
                f"policy.encoder='{TIMM_PREFIX}{model_name}' cannot read {h}x{w} images "
                f"({e}). Use a convolutional model such as {TIMM_EXAMPLE!r}."
            ) from e
        finally:
            self.backbone.train()

    def train(self, mode: bool = True) -> "TimmEncoder":
        """Normalisation layers always use their running statistics: in train mode BatchNorm
        would normalise by each minibatch, so the learner's log-probs would differ from the
        rollout worker's (eval mode) and PPO's ratio would not start at 1."""
        super().train(mode)
        for m in self.backbone.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
        return self

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        lead = rgb.shape[:-3]
        x = rgb.reshape(-1, *rgb.shape[-3:]).permute(0, 3, 1, 2).float() / PIXEL_MAX
        x = (x - self.mean) / self.std  # (B, C, H, W)
        return self.fc(self.backbone(x)).reshape(*lead, -1)  # (..., feature_dim)


def _encoder(cfg: CNNPolicyConfig, image_shape: tuple[int, int, int]) -> nn.Module:
    if cfg.encoder == NATURE_ENCODER:
        return NatureCNN(image_shape, cfg.feature_dim)
    model_name = cfg.encoder[len(TIMM_PREFIX):]
    return TimmEncoder(image_shape, cfg.feature_dim, model_name, cfg.encoder_weights)


class GaussianCNNPolicy(GaussianActorCritic):
    """``policy.name=cnn``; its settings: :class:`CNNPolicyConfig`.

    >>> from m2flow.envs import EnvSpec
    >>> spec = EnvSpec({"rgb": (36, 36, 3), "state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)
    >>> cfg = CNNPolicyConfig(name="cnn", hidden_sizes=[8], feature_dim=16)
    >>> pi = GaussianCNNPolicy(cfg, spec)
    >>> obs = {"rgb": torch.zeros(3, 36, 36, 3, dtype=torch.uint8), "state": torch.zeros(3, 5)}
    >>> out = pi.act(TensorDict({"obs": obs}, batch_size=[3]))
    >>> out["action"].shape, out["log_prob"].shape, out["value"].shape
    (torch.Size([3, 2]), torch.Size([3]), torch.Size([3]))
    """

    config_class = CNNPolicyConfig

    @staticmethod
    def check_config(policy_cfg: CNNPolicyConfig, env_cfg) -> None:
        """Raises PolicyError for a state-only env, bad heads, encoder or auxiliary loss."""
        if env_cfg.obs_mode == "state":
            raise PolicyError(
                "policy=cnn reads ('obs','rgb') images, but env.obs_mode=state renders none; "
                "use env.obs_mode=rgb or policy=mlp."
            )
        GaussianActorCritic.check_config(policy_cfg, env_cfg)
        _check(policy_cfg)
        critics.StateAux.check(policy_cfg.state_aux, env_cfg)

    def __init__(self, cfg: CNNPolicyConfig, env_spec):
        super().__init__()
        shapes = env_spec.obs_shapes
        if "rgb" not in shapes or len(shapes["rgb"]) != 3:
            raise PolicyError(
                "policy.name='cnn' needs ('obs', 'rgb') images (H, W, C); this env gives "
                f"{shapes}. Set env.obs_mode=rgb, or use policy.name=mlp for state."
            )
        if "state" in shapes and len(shapes["state"]) != 1:
            raise PolicyError(
                f"policy.name='cnn' reads ('obs', 'state') as a flat vector; this env gives "
                f"{shapes['state']}. Flatten it in the env adapter."
            )
        if cfg.activation not in ACTIVATIONS:  # before building an encoder for nothing
            raise PolicyError(
                f"policy.activation={cfg.activation!r}: use one of {sorted(ACTIVATIONS)}."
            )
        _check(cfg)
        state_dim = shapes["state"][0] if "state" in shapes else 0
        self.has_state = "state" in shapes
        self.encoder = _encoder(cfg, tuple(shapes["rgb"]))
        self.task_emb = task_embedding.build(cfg.task_embedding, env_spec)
        # [image features, state, E[task]]
        n_features = cfg.feature_dim + state_dim + task_embedding.width(self.task_emb)
        self._build_heads(n_features, env_spec.action_dim, cfg)
        ranges = hidden_state.ranges(cfg.actor_hidden_state,
                                     state_dim if self.has_state else None, HIDE_FIELD)
        if ranges and not self.has_state:
            raise PolicyError("policy.actor_hidden_state hides dims of ('obs', 'state'), "
                              f"but this env gives none ({shapes}); drop the setting.")
        self._hide_from_actor(ranges, cfg.feature_dim, n_features)
        self.state_norm = state_norm(state_dim, cfg, self.has_state)
        self.privileged_critic = cfg.critic == PRIVILEGED_CRITIC
        if self.privileged_critic:  # replaces the critic over the encoder's features
            self.critic = critics.privileged_critic(env_spec, cfg.hidden_sizes, cfg.activation)
        self.state_aux = critics.StateAux.build(n_features, shapes, cfg.state_aux)

    def _features(self, obs: TensorDict) -> torch.Tensor:
        features = self.encoder(obs[keys.leaf(keys.RGB)])
        if self.has_state:
            features = torch.cat([features, self.state_norm(obs[keys.leaf(keys.STATE)])], dim=-1)
        return task_embedding.append(self.task_emb, features, obs)  # (B, feature_dim + D [+ E])

    def _value(self, obs: TensorDict, features: torch.Tensor) -> torch.Tensor:
        if not self.privileged_critic:
            return super()._value(obs, features)
        return self.critic(obs)

    def _aux_loss(self, obs: TensorDict, features: torch.Tensor):
        return None if self.state_aux is None else self.state_aux.loss(obs, features)

    def value(self, obs: TensorDict) -> torch.Tensor:
        if self.privileged_critic:  # no image encoder forward for it
            return self.critic(obs)
        return super().value(obs)

    def observe(self, batch: TensorDict) -> None:
        if isinstance(self.state_norm, RunningNorm):
            self.state_norm.update(batch[keys.STATE])
        if self.privileged_critic:
            self.critic.observe(batch)
        if self.state_aux is not None:
            self.state_aux.observe(batch)
