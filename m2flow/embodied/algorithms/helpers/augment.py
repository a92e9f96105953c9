"""Image augmentation for learning from pixels: random shifts (DrQ, Kostrikov et al. 2020).

Each image is padded by ``pad`` pixels on every side, repeating its edge pixels, and cropped
back to its size at an offset drawn uniformly from [0, 2 * pad] in each direction, per image:
the scene moves by up to ``pad`` pixels, which keeps a small image encoder from memorising
exact pixel positions of a few thousand expert frames.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict


def random_shift(images: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """``images`` (B, H, W, C), each shifted by its own offset of up to ``pad`` pixels
    (edge pixels repeated where the shift uncovers the border); dtype and shape kept.

    >>> img = torch.arange(9, dtype=torch.uint8).reshape(1, 3, 3, 1)
    >>> # offsets (dy, dx) = (0, 2) with pad 1: the scene moves down one pixel and left one
    >>> out = _shift(img, 1, torch.tensor([0]), torch.tensor([2]))
    >>> out[0, ..., 0].tolist()
    [[1, 2, 2], [1, 2, 2], [4, 5, 5]]
    """
    if pad <= 0:
        return images
    b = images.shape[0]
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    return _shift(images, pad, dy, dx)


def _shift(images: torch.Tensor, pad: int, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """``images`` (B, H, W, C) padded by ``pad`` (edges repeated) and cropped at (dy, dx)."""
    b, h, w, _ = images.shape
    # edge padding as index clamping: row r of the padded image is row clamp(r - pad)
    rows = (torch.arange(h)[None, :] + dy.to(torch.long)[:, None] - pad).clamp(0, h - 1)
    cols = (torch.arange(w)[None, :] + dx.to(torch.long)[:, None] - pad).clamp(0, w - 1)
    batch = torch.arange(b)[:, None, None]
    return images[batch, rows[:, :, None].to(images.device), cols[:, None, :].to(images.device)]


def shift_images(obs: TensorDict, pad: int, gen: torch.Generator) -> TensorDict:
    """``obs`` (B,) with every image (a uint8 leaf of shape (B, H, W, C)) randomly shifted,
    each camera by its own offsets; other leaves as they were (the same tensors)."""
    if pad <= 0:
        return obs
    out = obs.apply(lambda x: x)  # a new structure (nested too) holding the same tensors
    for key, value in obs.items(include_nested=True, leaves_only=True):
        if value.dtype == torch.uint8 and value.ndim == 4:
            out[key] = random_shift(value, pad, gen)
    return out
