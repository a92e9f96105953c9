"""What OpenVLA's LIBERO evaluation does to images before the model and to actions after it.

Transcribed from OpenVLA / OpenVLA-OFT's ``experiments/robot`` code (``openvla_utils.py``,
``robot_utils.py``, ``libero/libero_utils.py``), batched in torch so it runs where the policy
runs. The steps, in the order the evaluation applies them:

1. turn LIBERO's frames upright (``img[::-1, ::-1]``): done by the env (``LIBERO/<suite>``);
2. ``resize_image_for_policy``: when the frame is not the model's size, JPEG-encode and decode
   it (as the RLDS dataset builder did to the training images), then
   ``tf.image.resize(method="lanczos3", antialias=True)``, rounded and clipped to uint8:
   :func:`jpeg_round_trip` and :func:`resize_lanczos3`;
3. ``center_crop_image`` (checkpoints trained with random-crop augmentation): crop the central
   90% of the area and resize back with ``tf.image.crop_and_resize`` (bilinear), in [0, 1]
   floats, then ``tf.image.convert_image_dtype`` back to uint8: :func:`center_crop`;
4. actions: ``normalize_gripper_action(binarize=True)`` maps the gripper from the dataset's
   [0, 1] to [-1, +1] and takes its sign; ``invert_gripper_action`` flips it, because the
   datasets store 1 = open and LIBERO/robosuite wants -1 = open: :func:`libero_gripper`.

TensorFlow is not a dependency: the resize and crop kernels are re-implemented from TF's C++
(``scale_and_translate_op.cc``: Lanczos3 kernel, antialiasing by widening the kernel,
normalised weights, float32 arithmetic; ``crop_and_resize_op.cc``: the box's sample grid and
lerps). The JPEG round trip goes through libjpeg via PIL with TF's ``encode_jpeg`` defaults
(quality 95, 4:2:0 chroma subsampling, accurate integer DCT); it is not checked against TF.

>>> img = torch.arange(4 * 4 * 3, dtype=torch.uint8).reshape(1, 4, 4, 3)
>>> resize_lanczos3(img, 2).shape
torch.Size([1, 2, 2, 3])
>>> libero_gripper(torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.9]]))[0, -1].item()
-1.0
"""

from __future__ import annotations

import io

import numpy as np
import torch

LANCZOS_RADIUS = 3
"""``tf.image.resize(method="lanczos3")``: the Lanczos kernel of radius 3."""
JPEG_QUALITY = 95
"""``tf.image.encode_jpeg``'s default quality."""
JPEG_SUBSAMPLING = 2
"""PIL's code for 4:2:0 chroma subsampling (``encode_jpeg``'s ``chroma_downsampling=True``)."""
CROP_SCALE = 0.9
"""``center_crop_image``: the crop keeps this fraction of the image's area."""
UINT8_MAX = 255


# -- images: (B, H, W, 3) uint8 in, the same out ---------------------------------------------
def jpeg_round_trip(images: torch.Tensor) -> torch.Tensor:
    """Each image JPEG-encoded and decoded again (quality 95, 4:2:0), as OpenVLA's RLDS
    builder stored the training frames and ``resize_image_for_policy`` re-does at test time."""
    from PIL import Image

    out = []
    for img in images.cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=JPEG_QUALITY,
                                  subsampling=JPEG_SUBSAMPLING)
        out.append(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
    return torch.from_numpy(np.stack(out)).to(images.device)


def _lanczos3(x: torch.Tensor) -> torch.Tensor:
    """TF's ``LanczosKernelFunc(3)``: ``3 sin(pi x) sin(pi x / 3) / (pi x)^2`` on |x| <= 3."""
    x = x.abs()
    pi = 3.14159265359  # TF's constant
    safe = x.clamp_min(1e-3)
    w = LANCZOS_RADIUS * torch.sin(pi * safe) * torch.sin(pi * safe / LANCZOS_RADIUS) / (pi * pi * safe * safe)
    w = torch.where(x <= 1e-3, torch.ones_like(w), w)
    return torch.where(x > LANCZOS_RADIUS, torch.zeros_like(w), w)


def lanczos3_weights(in_size: int, out_size: int) -> torch.Tensor:
    """(out_size, in_size) float32 weights of ``tf.image.resize(lanczos3, antialias=True)``
    along one axis (TF's ``ComputeSpansCore`` with scale ``out/in`` and no translation)."""
    inv_scale = in_size / out_size
    kernel_scale = max(inv_scale, 1.0)  # antialias: widen the kernel when shrinking
    sample = (torch.arange(out_size, dtype=torch.float32) + 0.5) * inv_scale  # (out,)
    start = torch.ceil(sample - LANCZOS_RADIUS * kernel_scale - 0.5).clamp(0, in_size - 1)
    end = torch.floor(sample + LANCZOS_RADIUS * kernel_scale - 0.5).clamp(0, in_size - 1) + 1
    src = torch.arange(in_size, dtype=torch.float32)  # (in,)
    in_span = (src[None] >= start[:, None]) & (src[None] < end[:, None])
    w = _lanczos3((src[None] + 0.5 - sample[:, None]) / kernel_scale) * in_span
    total = w.sum(1, keepdim=True)
    return torch.where(total.abs() > 0, w / total, w)


def resize_lanczos3(images: torch.Tensor, size: int) -> torch.Tensor:
    """``tf.image.resize(img, (size, size), "lanczos3", antialias=True)``, then
    ``round`` (half to even) and clip to uint8; (B, H, W, 3) uint8 -> (B, size, size, 3)."""
    b, h, w, _ = images.shape
    if (h, w) == (size, size):  # the kernel is 1 at 0 and 0 at the other integers
        return images
    wy = lanczos3_weights(h, size).to(images.device)
    wx = lanczos3_weights(w, size).to(images.device)
    x = images.float()
    x = torch.einsum("oh,bhwc->bowc", wy, x)
    x = torch.einsum("pw,bowc->bopc", wx, x)
    return x.round().clamp(0, UINT8_MAX).to(torch.uint8)


def center_crop(images: torch.Tensor, crop_scale: float = CROP_SCALE,
                size: int | None = None) -> torch.Tensor:
    """OpenVLA's ``center_crop_image``: the central ``crop_scale`` of the area, resized to
    ``size`` (default: the input's) by ``tf.image.crop_and_resize`` (bilinear, float32 in
    [0, 1]), then back to uint8 as ``convert_image_dtype(saturate=True)`` does."""
    b, h, w, _ = images.shape
    out = size or h
    side = np.float32(np.clip(np.sqrt(np.float32(crop_scale)), 0, 1))
    lo = np.float32((np.float32(1) - side) / np.float32(2))
    hi = np.float32(lo + side)
    x = images.float() * np.float32(1 / UINT8_MAX)  # convert_image_dtype(uint8 -> float32)
    ys = _crop_coords(lo, hi, h, out, images.device)
    xs = _crop_coords(lo, hi, w, out, images.device)
    y0, y1, fy = ys
    x0, x1, fx = xs
    top_left, top_right = x[:, y0][:, :, x0], x[:, y0][:, :, x1]
    bottom_left, bottom_right = x[:, y1][:, :, x0], x[:, y1][:, :, x1]
    fx = fx[None, None, :, None]
    top = top_left + (top_right - top_left) * fx
    bottom = bottom_left + (bottom_right - bottom_left) * fx
    crop = top + (bottom - top) * fy[None, :, None, None]
    crop = crop.clamp(0, 1) * np.float32(UINT8_MAX + 0.5)  # convert_image_dtype(float -> uint8)
    return crop.clamp(0, UINT8_MAX).to(torch.uint8)  # saturate_cast truncates


def _crop_coords(lo, hi, in_size: int, out_size: int, device):
    """``crop_and_resize``'s sample positions along one axis: (floor index, ceil index, lerp)."""
    n = np.float32(in_size - 1)
    if out_size > 1:
        step = np.float32((hi - lo) * n / np.float32(out_size - 1))
        pos = np.float32(lo * n) + np.arange(out_size, dtype=np.float32) * step
    else:
        pos = np.full(1, np.float32(0.5) * (lo + hi) * n, dtype=np.float32)
    pos = torch.from_numpy(pos.astype(np.float32)).to(device)
    i0 = pos.floor()
    return i0.long(), pos.ceil().long().clamp(max=in_size - 1), pos - i0


def prepare_images(images: torch.Tensor, size: int, *, resize: str = "lanczos3",
                   jpeg: bool = True, crop: bool = True) -> torch.Tensor:
    """OpenVLA's ``prepare_images_for_vla`` on a batch: (B, H, W, 3) uint8 (already upright) ->
    (B, size, size, 3) uint8. Frames of another size are JPEG round-tripped (``jpeg``) and
    resized (``resize``: 'lanczos3' as OpenVLA, or 'bilinear'); then centre-cropped (``crop``).
    Always in float32, also inside the learner's bf16 autocast: rollout and training must see
    the same pixels."""
    with torch.autocast(images.device.type, enabled=False):
        return _prepare(images, size, resize, jpeg, crop)


def _prepare(images: torch.Tensor, size: int, resize: str, jpeg: bool, crop: bool) -> torch.Tensor:
    if images.shape[1:3] != (size, size):
        if jpeg:
            images = jpeg_round_trip(images)
        if resize == "lanczos3":
            images = resize_lanczos3(images, size)
        else:
            x = torch.nn.functional.interpolate(images.permute(0, 3, 1, 2).float(), size=(size, size),
                                                mode="bilinear", antialias=True, align_corners=False)
            images = x.round().clamp(0, UINT8_MAX).to(torch.uint8).permute(0, 2, 3, 1)
    return center_crop(images) if crop else images


RESIZES = ("lanczos3", "bilinear")


# -- actions ---------------------------------------------------------------------------------
def normalize_gripper_action(action: torch.Tensor, binarize: bool = True) -> torch.Tensor:
    """The last dimension from [0, 1] to [-1, +1] (``2 x - 1``), and its sign if ``binarize``
    (0 stays 0, as ``np.sign``)."""
    out = action.clone()
    out[..., -1] = 2 * out[..., -1] - 1
    if binarize:
        out[..., -1] = torch.sign(out[..., -1])
    return out


def invert_gripper_action(action: torch.Tensor) -> torch.Tensor:
    """The last dimension's sign flipped (datasets: 1 = open; robosuite: -1 = open)."""
    out = action.clone()
    out[..., -1] = -out[..., -1]
    return out


def libero_gripper(action: torch.Tensor) -> torch.Tensor:
    """``process_action`` of OpenVLA's ``run_libero_eval.py`` (model family openvla):
    normalise and binarise the gripper, then invert it."""
    return invert_gripper_action(normalize_gripper_action(action, binarize=True))


GRIPPERS = {"as_is": None, "libero": libero_gripper}
"""``policy.gripper``: how the decoded action's last dimension reaches the env."""

