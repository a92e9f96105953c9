"""Does a vision tower see the cube? Supervised probes on a PushCube demos file (issue 46(c)).

Two questions, each answered as held-out R^2 of the cube's and the goal's xy (the simulator
state dims that vary between episodes: ManiSkill's PushCube state has the cube's pose at dims
13-25 and the goal's at 26-38), on the file's last 50 episodes, after training on the others:

- ``towers``: a tower alone, trained from scratch with a linear head on its flattened image
  tokens (the VLA's random ViT at its patch size and depth, or the CNN's NatureCNN), for
  ``--steps`` Adam steps at ``--lr`` on batches of ``--batch`` frames. High R^2: the tower
  can locate the cube from these frames when told where it is.
- ``--checkpoint <file>``: a tiny OpenVLA-OFT checkpoint trained with ``policy.state_aux``:
  R^2 of its auxiliary head, which reads the LM's state at the last prompt token (where the
  first action token is predicted). High R^2: the LM carries the cube's position to where
  the actions are read.

    python bench/vision_probe.py --demos demos/PushCube-v1_rgb64_priv_400.h5 cnn p16d12
    python bench/vision_probe.py --demos demos/PushCube-v1_rgb64_priv_400.h5 \\
        --checkpoint runs/vla_bc_aux/<time>/checkpoints/iter_00200.pt
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HELD_OUT = 50
CUBE_GOAL_XY = [13, 14, 26, 27]
TOWERS = {"p16d12": {}, "p8d12": {"patch_size": 8}, "p16d2": {"depth": 2},
          "p8d2": {"patch_size": 8, "depth": 2}}
"""The tiny VLA's tower (timm/vit_tiny_patch16_224 at 64 px) with these changes."""


def episodes(path: str) -> list:
    f = h5py.File(path, "r")
    return [f[k] for k in sorted(f, key=lambda k: int(k.split("_")[1]))]


def stack(eps, key: str) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([e[f"obs/{key}"][:-1] for e in eps]))


class ViTTokens(nn.Module):
    """The VLA's image path: the random ViT's second-to-last block, the projector, flattened."""

    def __init__(self, **shape):
        super().__init__()
        from m2flow.policies.vla.prismatic import Projector, vision_backbone

        self.bb = vision_backbone("timm/vit_tiny_patch16_224", 64, **shape)
        self.proj = Projector(self.bb.num_features, 128, fused=False)
        self.out = self.bb.patch_embed.num_patches * 128

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        x = (rgb.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
        (t,) = self.bb.get_intermediate_layers(x, n={len(self.bb.blocks) - 2})
        return self.proj(t).flatten(1)


class CNNTokens(nn.Module):
    def __init__(self):
        super().__init__()
        from m2flow.policies.cnn import NatureCNN

        self.net, self.out = NatureCNN((64, 64, 3), 256), 256

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        return self.net(rgb)


def r2(pred: torch.Tensor, target: torch.Tensor) -> list[float]:
    return (1 - ((pred - target) ** 2).mean(0) / target.var(0)).tolist()


def probe_tower(name: str, eps, steps: int, batch: int, lr: float) -> str:
    train, test = eps[:-HELD_OUT], eps[-HELD_OUT:]
    x_tr, x_te = stack(train, "rgb"), stack(test, "rgb")
    y_tr = stack(train, "privileged")[:, CUBE_GOAL_XY]
    y_te = stack(test, "privileged")[:, CUBE_GOAL_XY]
    mu, sd = y_tr.mean(0), y_tr.std(0) + 1e-6
    y_tr, y_te = (y_tr - mu) / sd, (y_te - mu) / sd
    torch.manual_seed(0)
    enc = CNNTokens() if name == "cnn" else ViTTokens(**TOWERS[name])
    head = nn.Linear(enc.out, y_tr.shape[1])
    opt = torch.optim.Adam([*enc.parameters(), *head.parameters()], lr=lr)
    gen, t0 = torch.Generator().manual_seed(0), time.time()
    for _ in range(steps):
        i = torch.randint(0, len(x_tr), (batch,), generator=gen)
        loss = F.mse_loss(head(enc(x_tr[i])), y_tr[i])
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        pred = torch.cat([head(enc(x_te[j:j + 512])) for j in range(0, len(x_te), 512)])
    return (f"{name}: {steps} steps of {batch} at lr {lr:g}: held-out R^2 cube x, y, goal x, "
            f"y = {np.round(r2(pred, y_te), 3).tolist()}; {time.time() - t0:.0f} s")


def probe_checkpoint(path: str, eps) -> str:
    import yaml
    from tensordict import TensorDict

    from m2flow.envs.base import EnvSpec
    from m2flow.policies import make_policy, policy_config
    from m2flow.runs import checkpoint

    c = checkpoint.load(path)
    cfg = yaml.safe_load(c["config"])["policy"]
    test = eps[-HELD_OUT:]
    rgb, state, priv = stack(test, "rgb"), stack(test, "state"), stack(test, "privileged")
    spec = EnvSpec({"rgb": tuple(rgb.shape[1:]), "state": (state.shape[1],), "task": (),
                    "privileged": (priv.shape[1],)}, 4, (-1.0,) * 4, (1.0,) * 4, 100,
                   tasks=("push the cube",))
    p = make_policy(policy_config(**cfg), spec)
    p.load_state_dict(c["learner"]["policy"])
    if p.state_aux is None:
        raise SystemExit(f"{path}: trained without policy.state_aux; nothing to probe.")
    preds, targets = [], []
    with torch.no_grad():
        for i in range(0, len(rgb), 256):
            n = len(rgb[i:i + 256])
            obs = TensorDict({"rgb": rgb[i:i + 256], "state": state[i:i + 256],
                              "privileged": priv[i:i + 256],
                              "task": torch.zeros(n, dtype=torch.long)}, batch_size=[n])
            preds.append(p.state_aux.head(p._forward(obs)[2].float()))
            targets.append(p.state_aux.norm(obs["privileged"].float()))
    pred, target = torch.cat(preds)[:, CUBE_GOAL_XY], torch.cat(targets)[:, CUBE_GOAL_XY]
    return (f"{path}: state_aux head on the LM's last prompt token, held-out R^2 cube x, y, "
            f"goal x, y = {np.round(r2(pred, target), 3).tolist()} over {len(pred)} frames")


LM_VARIANTS = {"lm": {}, "lm_imgpos": {"image_positions": True},
               "lm_p8d2": {"patch_size": 8, "vision_depth": 2},
               "lm_sincos": {}, "lm_p8d2_sincos": {"patch_size": 8, "vision_depth": 2},
               "lm_p8d2_all": {"patch_size": 8, "vision_depth": 2}}
"""The whole tiny OpenVLA-OFT policy (``policy=openvla_oft_tiny``) with these settings;
``_all``: trained on every privileged dim, normalised as ``policy.state_aux`` normalises them
(near-constant dims blown up to unit noise), R^2 still of the four."""


def sincos_2d(bb) -> torch.Tensor:
    """MAE's fixed 2-D sine-cosine position embedding for ``bb``'s patch grid, unit scale."""
    gh, gw = bb.patch_embed.grid_size
    dim = bb.pos_embed.shape[-1]
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float32),
                          torch.arange(gw, dtype=torch.float32), indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    parts = [f(c.flatten()[:, None] * omega[None]) for c in (y, x) for f in (torch.sin, torch.cos)]
    emb = torch.cat(parts, dim=1)
    extra = bb.pos_embed.shape[1] - emb.shape[0]  # the class token's (and registers'): zero
    return torch.cat([torch.zeros(extra, dim), emb])[None]


def _spec_obs(n_state: int, n_priv: int, shape):
    from m2flow.envs.base import EnvSpec

    return EnvSpec({"rgb": shape, "state": (n_state,), "task": (), "privileged": (n_priv,)},
                   4, (-1.0,) * 4, (1.0,) * 4, 100, tasks=("push the cube",))


def probe_lm(name: str, eps, steps: int, batch: int, lr: float) -> str:
    """The whole policy trained, with a linear head on the LM's state at the last prompt
    token (where the first action token is read), to regress the cube's and the goal's xy:
    whether the LM can carry what the tower sees to where the actions are read at all."""
    import yaml
    from tensordict import TensorDict

    import m2flow.configs
    from m2flow.policies import make_policy, policy_config

    train, test = eps[:-HELD_OUT], eps[-HELD_OUT:]
    data = {split: {k: stack(e, k) for k in ("rgb", "state", "privileged")}
            for split, e in (("train", train), ("test", test))}
    every = name.endswith("_all")
    dims = slice(None) if every else CUBE_GOAL_XY
    y = {s: d["privileged"][:, dims].float() for s, d in data.items()}
    mu, var = y["train"].mean(0), y["train"].var(0, unbiased=False)
    y = {s: ((v - mu) / torch.sqrt(var + 1e-8)).clamp(-10, 10) for s, v in y.items()}
    read = CUBE_GOAL_XY if every else list(range(len(CUBE_GOAL_XY)))  # the four, in y
    cfg = yaml.safe_load((Path(m2flow.configs.__file__).parent / "policy"
                           / "openvla_oft_tiny.yaml").read_text())
    cfg = {k: v for k, v in cfg.items() if k != "defaults"} | LM_VARIANTS[name]
    torch.manual_seed(0)
    d = data["train"]
    spec = _spec_obs(d["state"].shape[1], d["privileged"].shape[1],
                     tuple(d["rgb"].shape[1:]))
    pol = make_policy(policy_config(**cfg), spec)
    if name.endswith("_sincos"):
        for bb in pol.vlm.backbones:
            with torch.no_grad():
                bb.pos_embed.copy_(sincos_2d(bb))
    head = nn.Linear(pol.vlm.hidden_size, y["train"].shape[1])
    params = [*pol.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=lr)

    def obs(split, i):
        d = data[split]
        return TensorDict({"rgb": d["rgb"][i], "state": d["state"][i],
                           "privileged": d["privileged"][i],
                           "task": torch.zeros(len(i), dtype=torch.long)}, batch_size=[len(i)])

    gen, t0 = torch.Generator().manual_seed(0), time.time()
    for _ in range(steps):
        i = torch.randint(0, len(y["train"]), (batch,), generator=gen)
        loss = F.mse_loss(head(pol._forward(obs("train", i))[2].float()), y["train"][i])
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    with torch.no_grad():
        n = len(y["test"])
        pred = torch.cat([head(pol._forward(obs("test", torch.arange(j, min(j + 256, n))))[2])
                          for j in range(0, n, 256)])
    return (f"{name}: {steps} steps of {batch} at lr {lr:g}: held-out R^2 cube x, y, goal x, "
            f"y = {np.round(r2(pred[:, read], y['test'][:, read]), 3).tolist()}; "
            f"{time.time() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", required=True, help="an m2flow-demos file with obs/privileged")
    ap.add_argument("--checkpoint", help="probe this VLA checkpoint's state_aux head instead")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    names = ["cnn", *TOWERS, *LM_VARIANTS]
    ap.add_argument("towers", nargs="*", default=[], help=f"any of {names}")
    a = ap.parse_args()
    bad = [t for t in a.towers if t not in names]
    if bad:
        ap.error(f"{bad[0]!r} is not a probe; use any of {names}")
    torch.set_num_threads(2)
    eps = episodes(a.demos)
    if a.checkpoint:
        print(probe_checkpoint(a.checkpoint, eps), flush=True)
    for name in a.towers:
        probe = probe_lm if name in LM_VARIANTS else probe_tower
        print(probe(name, eps, a.steps, a.batch, a.lr), flush=True)


if __name__ == "__main__":
    main()
