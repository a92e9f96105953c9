"""robosuite 1.4.0 as LIBERO's env processes run it: on MuJoCo 3.11 (m2flow's pin), and with
``env.render_quality=fast``.

robosuite 1.4.0 was written for MuJoCo 2.3-3.3; on MuJoCo 3.11 ``MjData.qM`` is gone and
``mj_fullM`` takes the data instead of the sparse matrix. :func:`robosuite_on_new_mujoco`
adapts robosuite's one such call (its controllers' mass matrix) in each env process.
"""

from __future__ import annotations


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


def fast_rendering(env) -> None:
    """No MSAA and no reflections for every render context this robosuite env creates."""
    import mujoco

    inner_reset = env._reset_internal

    def reset_internal():
        env.sim.model._model.vis.quality.offsamples = 0  # read when the context is made
        inner_reset()
        ctx = env.sim._render_context_offscreen
        if ctx is not None:
            ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0

    env._reset_internal = reset_internal
