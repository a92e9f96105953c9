"""The settings of ``policy.name=openvla_oft`` (and ``openvla``): their dataclass, their
checks at start-up (no weights loaded), and the weights' dtype. The model is
:mod:`m2flow.policies.vla.oft`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from m2flow.policies import critics, hidden_state
from m2flow.policies.base import PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.policies.vla import oft_checkpoint
from m2flow.policies.vla import preprocess
from m2flow.registry import Requires

TRAINABLE = ("proprio", "value_head", "queries", "projector", "vision")
"""Parts that may train beside the LoRA adapters (``policy.trainable``)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CRITICS = ("head", critics.PRIVILEGED)
PROPRIO_HIDDEN = "policy.proprio_hidden"


@dataclass
class OFTPolicyConfig(PolicyConfig):
    """``policy.name=openvla_oft``: the model (tiny and random, or a checkpoint's), its
    decoding, the image steps, and what trains."""

    vision: List[str] = field(default_factory=lambda: ["timm/vit_tiny_patch16_224"])
    """One timm ViT, or two fused per patch (OpenVLA: DINOv2 + SigLIP)."""
    image_size: int = 64
    """Backbone resolution (env images are resized to it)."""
    patch_size: Optional[int] = None
    """The tiny ViT's patch size (None: the model name's, 16 for vit_tiny_patch16_224). At
    64 px, 16 gives a 4 x 4 grid of patches per image, 8 an 8 x 8 one (four times the image
    tokens)."""
    vision_depth: Optional[int] = None
    """The tiny ViT's number of blocks (None: the model name's, 12 for vit_tiny_patch16_224);
    the image tokens are read after the second-to-last, as OpenVLA reads its towers'."""
    image_positions: bool = False
    """Add a learned embedding per image token (starting at zero) to the projected patches,
    so the LM reads where in the image each token is from the token itself and not only
    from the tower's own position embedding and the LM's rotary positions (not in OpenVLA's
    layout; always trains)."""
    image_keys: List[str] = field(default_factory=lambda: ["rgb", "wrist_rgb"])
    """Image observations to read, in this order (those the env has): openvla-oft's
    ``num_images_in_input`` images (the published LIBERO RL checkpoints read one: [rgb])."""
    use_proprio: Optional[bool] = None
    """Add one token projected from ``("obs", "state")``. None: with a checkpoint, whether it
    has a ``proprio_projector--*.pt``; without one, True."""
    proprio_hidden: List[List[int]] = field(default_factory=list)
    """[start, end) ranges of ``("obs", "state")``'s dims fed to the proprio projector as 0
    (after normalisation): the whole policy, its value head included, is blind to them (a
    privileged critic still reads the simulator state). [[9, 18]] hides ManiSkill Panda's
    joint velocities, which a cloned policy copies instead of choosing a motion (see
    ``m2flow.policies.hidden_state``). Empty: the whole state."""
    proprio_privileged: bool = False
    """A control, not a deployable policy: the proprio token also reads the simulator state
    (``("obs", "privileged")``, env.privileged_state=true), so the policy knows the object
    poses without seeing them. Behaviour cloning with and without it tells whether the vision
    tower is what limits the policy."""
    state_aux: float = 0.0
    """> 0: an auxiliary loss in training, this coefficient x the mean squared error of a
    linear head predicting the running-normalised simulator state (``("obs", "privileged")``,
    env.privileged_state=true; a demos file recorded with it) from the LM's state at the last
    prompt token, where the value head reads and the first action token is predicted. The
    vision tower then learns where the objects are from a dense, supervised signal as well as
    from the action tokens' (as ``policy.state_aux`` of the CNN); the policy still reads only
    its images, proprio and prompt, and acting never calls the head. 0: off."""
    chunk: int = 8
    """Actions decoded per forward pass (openvla-oft's ``NUM_ACTIONS_CHUNK``: 8 for LIBERO;
    must be the checkpoint's)."""
    hidden_size: int = 128
    """The tiny Llama's width (without a checkpoint)."""
    num_layers: int = 2
    """The tiny Llama's decoder layers."""
    num_heads: int = 4
    """The tiny Llama's attention heads (they divide ``hidden_size``)."""
    intermediate_size: int = 256
    """The tiny Llama's MLP width."""
    text_vocab: int = 512
    """Size of the locally built byte-level BPE (the LM vocabulary adds the 256 bins)."""
    temperature: float = 1.0
    """Sampling temperature of the bins (log-probs are scored at it too)."""
    top_k: int = 0
    """Sample among the k likeliest bins (0: all)."""
    value_head: bool = True
    """A critic on the last prompt token's state (PPO); GRPO does not need it."""
    critic: str = "head"
    """'privileged': an MLP over the simulator state instead (:mod:`m2flow.policies.critics`)."""
    unnorm: Optional[Dict[str, Any]] = None
    """{q01, q99, mask}: un-normalise actions into env units (None: actions are in [-1, 1])."""
    checkpoint: Optional[str] = None
    """A local directory in OpenVLA's Hugging Face layout (an OFT one: see
    :mod:`m2flow.policies.vla.oft_checkpoint`): its vision backbones, projector, LM, tokenizer
    and proprio projector replace the tiny ones (vision, image_size and the LM sizes are then
    its)."""
    unnorm_key: Optional[str] = None
    """With a checkpoint: the dataset whose statistics (``norm_stats``) un-normalise actions
    and normalise the proprio state."""
    prompt_suffix_ids: List[int] = field(default_factory=list)
    """Token ids appended to every prompt; OpenVLA with Llama-2's tokenizer ends prompts with
    the empty token 29871 (its ``predict_action`` adds it)."""
    stop_token: bool = True
    """End the sequence with ``</s>`` after the placeholders (openvla-oft and SimpleVLA-RL do;
    RLinf's own OFT forward drops it)."""
    resize: str = "lanczos3"
    """How frames of another size reach the backbone's: 'lanczos3' (OpenVLA's
    ``tf.image.resize(lanczos3, antialias=True)``) or 'bilinear'."""
    jpeg: bool = True
    """JPEG round trip before resizing (OpenVLA's ``resize_image_for_policy``)."""
    center_crop: bool = True
    """Crop the central 90% of the area and resize back (OpenVLA's ``center_crop_image``; the
    published LIBERO checkpoints were trained with random-crop augmentation)."""
    gripper: str = "as_is"
    """'libero': OpenVLA's LIBERO ``process_action`` on the decoded action's last dimension
    (dataset [0, 1], 1 = open -> robosuite's -1 open / +1 close, binarised); 'as_is': none."""
    lora_rank: int = 0
    """> 0: train LoRA adapters (``peft``, fp32) of this rank on the LM's linear layers and
    the parts in ``trainable``; everything else is frozen in ``dtype``. 0: train everything."""
    lora_alpha: int = 16
    """LoRA's scale numerator (the adapters' output is scaled by lora_alpha / lora_rank)."""
    trainable: List[str] = field(default_factory=lambda: ["proprio", "value_head"])
    """Under LoRA, the parts that train beside the adapters: any of proprio, value_head,
    queries, projector, vision."""
    dtype: str = "auto"
    """'float32', 'bfloat16', or 'auto' (bfloat16 when the policy is built for a CUDA device)."""
    gradient_checkpointing: bool = False
    """Recompute each LM layer's activations in the backward pass instead of keeping them (in
    training mode only; rollout is unaffected): far less memory for the learner's minibatches
    of a large model, at the cost of a second forward."""


def check_settings(o: OFTPolicyConfig) -> None:
    """PolicyError for a setting out of range (files and sizes are checked by the callers)."""
    if o.chunk < 1 or o.temperature <= 0 or o.top_k < 0:
        raise PolicyError("policy: chunk >= 1, temperature > 0 and top_k >= 0 are needed "
                          f"(got chunk={o.chunk}, temperature={o.temperature}, top_k={o.top_k}).")
    choices = {"dtype": ("auto", *DTYPES), "resize": preprocess.RESIZES,
               "gripper": tuple(preprocess.GRIPPERS)}
    for name, allowed in choices.items():
        if getattr(o, name) not in allowed:
            raise PolicyError(f"policy.{name}={getattr(o, name)!r}: use one of {list(allowed)}.")
    if o.vision_depth is not None and o.vision_depth < 2:
        raise PolicyError(f"policy.vision_depth={o.vision_depth}: must be >= 2 (the image "
                          "tokens are read after the second-to-last block).")
    critics.StateAux.check(o.state_aux)
    if o.critic not in CRITICS:
        raise PolicyError(f"policy.critic={o.critic!r}: use one of {list(CRITICS)} "
                          "('head': a value head on the LM; 'privileged': the simulator state).")
    hidden_state.ranges(o.proprio_hidden, None, PROPRIO_HIDDEN)
    bad = [t for t in o.trainable if t not in TRAINABLE]
    if bad:
        raise PolicyError(f"policy.trainable: {bad[0]!r} is not a part of the policy; "
                          f"use any of {list(TRAINABLE)}.")


def check_config(policy_cfg: OFTPolicyConfig, env_cfg) -> None:
    """Raises PolicyError for a state-only env, a bad setting, or a checkpoint directory
    that is not one or holds a layout that does not load; loads no weights."""
    o = policy_cfg
    if env_cfg.obs_mode == "state":
        raise PolicyError(
            f"policy={o.name} reads camera images, but env.obs_mode=state renders none; "
            "use env.obs_mode=rgb."
        )
    check_settings(o)
    check_wrist_camera(o, env_cfg)
    sizes = {"image_size": o.image_size, "patch_size": o.patch_size or 1,
             "hidden_size": o.hidden_size,
             "num_layers": o.num_layers, "num_heads": o.num_heads,
             "intermediate_size": o.intermediate_size, "text_vocab": o.text_vocab}
    for key, value in (sizes.items() if o.checkpoint is None else ()):  # else: its own
        if value < 1:
            raise PolicyError(f"policy.{key}={value}: must be >= 1.")
    if o.checkpoint is None and o.hidden_size % o.num_heads:
        raise PolicyError(
            f"policy.hidden_size={o.hidden_size}: must be a multiple of "
            f"policy.num_heads={o.num_heads}."
        )
    for key in ("patch_size", "vision_depth"):
        if o.checkpoint is not None and getattr(o, key) is not None:
            raise PolicyError(f"policy.{key} is the tiny ViT's; a checkpoint brings its "
                              f"own vision tower: drop policy.{key}.")
    if o.lora_rank < 0:
        raise PolicyError(f"policy.lora_rank={o.lora_rank}: must be >= 0 (0: no LoRA).")
    if o.lora_rank > 0:
        Requires(("peft",), "m2flow[vla]").check(f"policy.lora_rank={o.lora_rank}",
                                                 PolicyError)
    if o.critic == critics.PRIVILEGED:
        critics.check_env(env_cfg, "policy.critic=privileged", "use policy.critic=head")
    if o.proprio_privileged:
        critics.check_env(env_cfg, "policy.proprio_privileged=true", "drop it")
    critics.StateAux.check(o.state_aux, env_cfg)
    if o.checkpoint is not None:
        oft_checkpoint.check_options(o)


def check_wrist_camera(policy_cfg, env_cfg) -> None:
    """PolicyError if ``policy.image_keys`` reads ``wrist_rgb`` from an env told not to render
    it (LIBERO's ``env.wrist_camera=false``): the policy would otherwise drop it silently, as
    it drops the keys an env never has (ManiSkill's)."""
    if "wrist_rgb" in policy_cfg.image_keys and getattr(env_cfg, "wrist_camera", True) is False:
        raise PolicyError(
            f"policy.image_keys={list(policy_cfg.image_keys)} reads wrist_rgb, but "
            "env.wrist_camera=false renders no wrist camera; set policy.image_keys=[rgb] or "
            "env.wrist_camera=true."
        )


def weights_dtype(name: str, device="cpu") -> torch.dtype:
    """The weights' dtype: ``name``, or for 'auto' bfloat16 when ``device`` is a CUDA device and
    float32 elsewhere (whatever else the machine has).

    >>> [weights_dtype(*a) for a in (("auto", "cpu"), ("auto", "cuda:1"), ("float32", "cuda"))]
    [torch.float32, torch.bfloat16, torch.float32]
    """
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise PolicyError(f"policy.dtype={name!r}: use 'auto', 'float32' or 'bfloat16'.")
    return DTYPES[name]
