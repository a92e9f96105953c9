"""Random-shift augmentation: each image equals a plain numpy edge-pad-and-crop at its own
offset, every offset in [0, 2 * pad]^2 is drawn about equally often, only images change, and
algorithm.bc's sample gets shifted images of the same expert steps."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms.helpers.augment import _shift, random_shift, shift_images
from m2flow.embodied.algorithms.base import AlgorithmError
from m2flow.embodied.algorithms.bc import BCConfig


def numbered(b=1, h=16, w=16, c=3):
    """Images whose pixel (r, col) holds r * w + col in every channel (all distinct)."""
    img = (torch.arange(h)[:, None] * w + torch.arange(w)[None, :]).to(torch.uint8)
    return img[None, :, :, None].expand(b, h, w, c).contiguous()


def numpy_shift(img: np.ndarray, pad: int, dy: int, dx: int) -> np.ndarray:
    h, w = img.shape[:2]
    padded = np.pad(img, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    return padded[dy:dy + h, dx:dx + w]


def test_each_image_is_the_edge_padded_crop_at_its_offset():
    gen = torch.Generator().manual_seed(0)
    imgs = torch.randint(0, 256, (32, 12, 10, 3), dtype=torch.uint8, generator=gen)
    dy, dx = torch.randint(0, 9, (32,), generator=gen), torch.randint(0, 9, (32,), generator=gen)
    out = _shift(imgs, 4, dy, dx)
    assert out.shape == imgs.shape and out.dtype == torch.uint8
    for i in range(32):
        want = numpy_shift(imgs[i].numpy(), 4, int(dy[i]), int(dx[i]))
        assert np.array_equal(out[i].numpy(), want), i


def test_every_offset_is_drawn_about_equally_often_and_pad_0_is_the_identity():
    pad, n = 2, 5000
    imgs = numbered(n)
    out = random_shift(imgs, pad, torch.Generator().manual_seed(1))
    # the centre pixel (8, 8) shows which one of the input it came from: (8 + dy - pad, ...)
    centre = out[:, 8, 8, 0].long()
    dy, dx = centre // 16 - 8 + pad, centre % 16 - 8 + pad
    counts = torch.bincount(dy * (2 * pad + 1) + dx, minlength=(2 * pad + 1) ** 2)
    assert counts.numel() == 25 and counts.min() > 0.7 * n / 25 and counts.max() < 1.3 * n / 25
    for i in range(0, n, 499):  # and each is that offset's crop
        want = numpy_shift(imgs[i].numpy(), pad, int(dy[i]), int(dx[i]))
        assert np.array_equal(out[i].numpy(), want)
    assert random_shift(imgs, 0, torch.Generator()) is imgs


def test_shift_images_changes_only_the_images_each_camera_by_its_own_offsets():
    obs = TensorDict({"rgb": numbered(64), "wrist_rgb": numbered(64),
                      "state": torch.randn(64, 5)}, batch_size=[64])
    nested = TensorDict({"obs": obs}, batch_size=[64])
    before = nested["obs", "rgb"].clone()
    out = shift_images(nested, 3, torch.Generator().manual_seed(2))
    assert out["obs", "state"] is nested["obs", "state"]
    assert torch.equal(nested["obs", "rgb"], before)  # the input is not changed
    moved = (out["obs", "rgb"] != before).flatten(1).any(1)
    assert 0.8 < moved.float().mean() < 1.0  # 1 in 49 offsets is (3, 3): no move
    assert not torch.equal(out["obs", "rgb"], out["obs", "wrist_rgb"])


def test_bc_samples_the_same_steps_with_shifted_images(tmp_path):
    """Two BC learners on one dataset, with and without image_shift: each iteration's sample
    holds the same steps (states, actions), and the images are shifts of the same frames."""
    from m2flow.embodied.algorithms.bc import BC

    n = 40
    data = TensorDict({"obs": TensorDict({"rgb": numbered(n), "state": torch.randn(n, 3)}, [n]),
                       "action": torch.rand(n, 2) * 2 - 1}, batch_size=[n])
    path = tmp_path / "d.pt"
    torch.save(data, path)
    shifted = BC(BCConfig(dataset=str(path), batch_size=16, image_shift=2), action_dim=2, seed=0)
    plain = BC(BCConfig(dataset=str(path), batch_size=16), action_dim=2, seed=0)
    policy, traj = torch.nn.Linear(1, 1), TensorDict({}, batch_size=[1])
    for it in range(3):
        a, _ = shifted.prepare(policy, traj, iteration=it, staleness=0)
        b, _ = plain.prepare(policy, traj, iteration=it, staleness=0)
        assert torch.equal(a["obs", "state"], b["obs", "state"])
        assert torch.equal(a["action"], b["action"])
        assert not torch.equal(a["obs", "rgb"], b["obs", "rgb"])
        centre = a["obs", "rgb"][:, 8, 8, 0].long()
        assert ((centre // 16 - 8).abs() <= 2).all() and ((centre % 16 - 8).abs() <= 2).all()
        again, _ = shifted.prepare(policy, traj, iteration=it, staleness=0)
        assert torch.equal(again["obs", "rgb"], a["obs", "rgb"])  # seeded by the iteration


def test_a_negative_image_shift_is_refused():
    with pytest.raises(AlgorithmError, match=r"algorithm.image_shift=-1: must be >= 0"):
        BCConfig(dataset="x.h5", image_shift=-1).validate()
