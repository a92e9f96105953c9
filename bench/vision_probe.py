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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", required=True, help="an m2flow-demos file with obs/privileged")
    ap.add_argument("--checkpoint", help="probe this VLA checkpoint's state_aux head instead")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("towers", nargs="*", choices=["cnn", *TOWERS], default=[])
    a = ap.parse_args()
    torch.set_num_threads(2)
    eps = episodes(a.demos)
    if a.checkpoint:
        print(probe_checkpoint(a.checkpoint, eps), flush=True)
    for name in a.towers:
        print(probe_tower(name, eps, a.steps, a.batch, a.lr), flush=True)


if __name__ == "__main__":
    main()
