"""robosuite 1.4.0 as LIBERO's env processes run it: on MuJoCo 3.11 (m2flow's pin), with
``env.render_quality=fast``, and without rendering the frames a reset throws away.

robosuite 1.4.0 was written for MuJoCo 2.3-3.3; on MuJoCo 3.11 ``MjData.qM`` is gone and
``mj_fullM`` takes the data instead of the sparse matrix. :func:`robosuite_on_new_mujoco`
adapts robosuite's one such call (its controllers' mass matrix) in each env process.
"""

from __future__ import annotations

import contextlib


class _FullMFromData:
    """``mujoco`` as robosuite's controllers see it, with MuJoCo < 3.11's ``mj_fullM(m, dst, qM)``.

    Their one call passes ``sim.data.qM``; on MuJoCo >= 3.11 that attribute (see
    :func:`robosuite_on_new_mujoco`) is the ``mujoco.MjData`` itself, which the new
    ``mj_fullM(m, d, dst)`` reads the sparse matrix from. Every other name is ``mujoco``'s.
    """

    def __init__(self, mujoco):
        self._mujoco = mujoco

    def mj_fullM(self, model, dst, data):
        self._mujoco.mj_fullM(model, data, dst)

    def __getattr__(self, name):
        return getattr(self._mujoco, name)


def robosuite_on_new_mujoco() -> None:
    """Lets robosuite 1.4.0 run on MuJoCo >= 3.11 (no-op on older MuJoCo, idempotent).

    robosuite's only use of the removed API is ``Controller.update``'s
    ``mujoco.mj_fullM(model, mass_matrix, sim.data.qM)`` (checked by grepping robosuite 1.4.0 and
    libero 0.1.1 for ``qM`` and ``mj_fullM``). Its ``MjData`` wrapper gains a ``qM`` that returns
    the wrapped ``mujoco.MjData``, and the controllers' module sees :class:`_FullMFromData` as
    ``mujoco``; nothing else of MuJoCo or robosuite changes.
    """
    import mujoco

    if hasattr(mujoco.MjData, "qM"):
        return
    from robosuite.controllers import base_controller
    from robosuite.utils import binding_utils

    if isinstance(base_controller.mujoco, _FullMFromData):
        return
    binding_utils.MjData.qM = property(lambda self: self._data)
    base_controller.mujoco = _FullMFromData(mujoco)


def fast_rendering(env, *, msaa: bool = False, reflections: bool = False) -> None:
    """No MSAA and no reflections for every render context this robosuite env creates
    (``env.render_quality=fast``); ``msaa`` / ``reflections``: keep that one (the breakdown of
    bench/libero_step_time.py times each alone).

    MSAA's sample count is read when a render context is made, and robosuite makes one at each
    (hard) reset, so both are set around its ``_reset_internal``."""
    import mujoco

    inner_reset = env._reset_internal

    def reset_internal():
        if not msaa:
            env.sim.model._model.vis.quality.offsamples = 0  # read when the context is made
        inner_reset()
        ctx = env.sim._render_context_offscreen
        if ctx is not None and not reflections:
            ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0

    env._reset_internal = reset_internal


@contextlib.contextmanager
def frames_unrendered(skip: bool = True):
    """Within (if ``skip``): robosuite's cameras read black frames of their size instead of
    rendering, in this process.

    For the frames a reset throws away: robosuite's reset renders each camera to check its
    sensor and for its first observation, setting the init state renders again, and each
    settle step once (its observables sample each camera once per step). Only the last settle
    step's frames reach the policy; nothing else reads the others, and rendering moves no
    state, so skipping them changes no frame and no number (tests/envs/test_libero.py checks
    the frames after settle steps against LIBERO's own env), and saves all but one render per
    camera of a reset (bench/libero_step_time.py).
    """
    if not skip:
        yield
        return
    import numpy as np
    from robosuite.utils.binding_utils import MjSim

    render = MjSim.__dict__["render"]

    def black(self, width=None, height=None, *, camera_name=None, depth=False, **_):
        rgb = np.zeros((height, width, 3), np.uint8)
        return (rgb, np.zeros((height, width), np.float32)) if depth else rgb

    MjSim.render = black
    try:
        yield
    finally:
        MjSim.render = render
