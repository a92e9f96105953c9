"""OpenVLA's evaluation preprocessing, checked against transcriptions of OpenVLA's own code and
of the TensorFlow kernels it calls (TF is not installed), plain loops in numpy, and against
independent libraries (PIL's Lanczos, OpenCV's JPEG)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from m2flow.policies.vla import preprocess as pp


def smooth_image(h, w, seed=0):
    """A camera-like frame: smooth shading plus blurred texture (no pixel-level noise, whose
    overshoot PIL clips between its two passes)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(x / 9 + c) * np.cos(y / 13 - c) for c in range(3)], -1)
    noise = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    texture = np.asarray(noise.filter(ImageFilter.GaussianBlur(2))).astype(float) - 128
    return np.clip(base + 0.5 * texture, 0, 255).astype(np.uint8)


# -- tf.image.resize(lanczos3, antialias=True), transcribed from scale_and_translate_op.cc ----
def tf_lanczos3_loop(img: np.ndarray, size: int) -> np.ndarray:
    """Per output pixel: TF's span, kernel and normalised weights, one axis then the other."""
    def kernel(x):
        x = abs(x)
        if x > 3:
            return 0.0
        if x <= 1e-3:
            return 1.0
        return 3 * math.sin(math.pi * x) * math.sin(math.pi * x / 3) / (math.pi * math.pi * x * x)

    def axis_weights(n_in, n_out):
        inv_scale = n_in / n_out
        kscale = max(inv_scale, 1.0)
        rows = []
        for i in range(n_out):
            sample = (i + 0.5) * inv_scale
            start = min(max(math.ceil(sample - 3 * kscale - 0.5), 0), n_in - 1)
            end = min(max(math.floor(sample + 3 * kscale - 0.5), 0), n_in - 1) + 1
            w = {j: kernel((j + 0.5 - sample) / kscale) for j in range(start, end)}
            total = sum(w.values())
            rows.append({j: v / total for j, v in w.items()})
        return rows

    h, w, _ = img.shape
    wy, wx = axis_weights(h, size), axis_weights(w, size)
    src = img.astype(np.float64)
    cols = np.zeros((size, w, 3))
    for i, row in enumerate(wy):
        for j, v in row.items():
            cols[i] += v * src[j]
    out = np.zeros((size, size, 3))
    for k, row in enumerate(wx):
        for j, v in row.items():
            out[:, k] += v * cols[:, j]
    return np.clip(np.round(out), 0, 255).astype(np.uint8)  # tf.round: half to even


@pytest.mark.parametrize("src, dst", [(40, 24), (13, 29)])  # shrink (antialiased) and grow
def test_lanczos3_resize_equals_tfs_kernel_computed_pixel_by_pixel(src, dst):
    img = smooth_image(src, src + 3)
    ours = pp.resize_lanczos3(torch.from_numpy(img[None]), dst)[0].numpy()
    ref = tf_lanczos3_loop(img, dst)
    diff = np.abs(ours.astype(int) - ref)
    # float32 here, float64 there: a value within 1e-5 of .5 may round the other way
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_lanczos3_resize_is_within_one_level_of_pils_lanczos():
    """PIL's LANCZOS is the same kernel with the same antialiasing (support scaled by the
    shrink factor); it rounds to uint8 between its horizontal and vertical passes, one
    rounding of <= 0.5 per pass: at most 1 level apart."""
    img = smooth_image(256, 256)
    ours = pp.resize_lanczos3(torch.from_numpy(img[None]), 224)[0].numpy().astype(int)
    pil = np.asarray(Image.fromarray(img).resize((224, 224), Image.LANCZOS)).astype(int)
    assert np.abs(ours - pil).max() <= 1
    assert not np.array_equal(ours, img[16:240, 16:240])  # it did resample


# -- center_crop_image: tf.image.crop_and_resize + convert_image_dtype, transcribed ---------
def openvla_center_crop_loop(img: np.ndarray, crop_scale=0.9) -> np.ndarray:
    """openvla_utils.center_crop_image: box of sqrt(crop_scale) per side, crop_and_resize
    (bilinear, crop_and_resize_op.cc) back to the input size, clip, convert to uint8."""
    h, w, _ = img.shape
    x = img.astype(np.float32) * np.float32(1 / 255)  # convert_image_dtype(uint8 -> float32)
    side = np.float32(np.clip(np.sqrt(np.float32(crop_scale)), 0, 1))
    y1 = x1 = np.float32((np.float32(1) - side) / np.float32(2))
    y2 = x2 = np.float32(y1 + side)
    hs = np.float32((y2 - y1) * np.float32(h - 1) / np.float32(h - 1))
    ws = np.float32((x2 - x1) * np.float32(w - 1) / np.float32(w - 1))
    out = np.zeros((h, w, 3), np.float32)
    for yi in range(h):
        in_y = np.float32(y1 * np.float32(h - 1) + np.float32(yi) * hs)
        top, bot = int(math.floor(in_y)), int(math.ceil(in_y))
        y_lerp = np.float32(in_y - np.float32(top))
        for xi in range(w):
            in_x = np.float32(x1 * np.float32(w - 1) + np.float32(xi) * ws)
            left, right = int(math.floor(in_x)), int(math.ceil(in_x))
            x_lerp = np.float32(in_x - np.float32(left))
            t = x[top, left] + (x[top, right] - x[top, left]) * x_lerp
            b = x[bot, left] + (x[bot, right] - x[bot, left]) * x_lerp
            out[yi, xi] = t + (b - t) * y_lerp
    out = np.clip(out, 0, 1) * np.float32(255.5)  # convert_image_dtype(float -> uint8), saturate
    return np.clip(out, 0, 255).astype(np.uint8)  # the cast truncates


def test_center_crop_equals_openvlas_crop_and_resize():
    img = smooth_image(36, 36, seed=1)
    ours = pp.center_crop(torch.from_numpy(img[None]))[0].numpy()
    ref = openvla_center_crop_loop(img)
    np.testing.assert_array_equal(ours, ref)  # the same float32 operations in the same order
    assert not np.array_equal(ours, img)  # the crop zoomed in


def test_jpeg_round_trip_equals_opencvs_libjpeg_at_tfs_defaults():
    """tf.image.encode_jpeg's defaults: quality 95, 4:2:0 chroma; OpenCV's imencode defaults to
    the same, through its own libjpeg binding."""
    import cv2

    img = smooth_image(40, 48, seed=2)
    ours = pp.jpeg_round_trip(torch.from_numpy(img[None]))[0].numpy()
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR),
                           [cv2.IMWRITE_JPEG_QUALITY, 95])
    ref = cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    assert ok and not np.array_equal(ours, img)  # lossy
    np.testing.assert_array_equal(ours, ref)


def test_prepare_images_resizes_only_frames_of_another_size():
    img = torch.from_numpy(smooth_image(32, 32)[None])
    assert torch.equal(pp.prepare_images(img, 32, crop=False), img)  # OpenVLA skips the resize
    assert pp.prepare_images(img, 16).shape == (1, 16, 16, 3)


def test_preprocessing_ignores_the_learners_autocast():
    """The learner recomputes log-probs under bf16 autocast: the pixels must not change."""
    img = torch.from_numpy(smooth_image(40, 40)[None])
    plain = pp.prepare_images(img, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(pp.prepare_images(img, 24), plain)


# -- actions: robot_utils.normalize_gripper_action / invert_gripper_action ----------------------
def openvla_process_action(action: np.ndarray) -> np.ndarray:
    """run_libero_eval.process_action for model_family openvla, as robot_utils writes it."""
    a = action.copy()
    a[..., -1] = 2 * (a[..., -1] - 0.0) / (1.0 - 0.0) - 1
    a[..., -1] = np.sign(a[..., -1])
    a = a.copy()
    a[..., -1] *= -1.0
    return a


def test_libero_gripper_equals_openvlas_process_action():
    grip = np.array([0.0, 0.2, 0.5, 0.51, 0.9, 1.0], dtype=np.float32)
    action = np.concatenate([np.full((6, 6), 0.3, np.float32), grip[:, None]], axis=1)
    ours = pp.libero_gripper(torch.from_numpy(action)).numpy()
    np.testing.assert_array_equal(ours, openvla_process_action(action))
    assert ours[:, -1].tolist() == [1.0, 1.0, 0.0, -1.0, -1.0, -1.0]  # 1 = open -> -1 = open
    np.testing.assert_array_equal(ours[:, :6], action[:, :6])
