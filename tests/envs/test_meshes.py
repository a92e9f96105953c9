"""Lighter visual meshes for CPU rendering (env.visual_mesh_fraction), against geometry worked
by hand and against the same ManiSkill scene rendered with its published meshes."""

import numpy as np
import pytest
import torch

from m2flow.envs import env_config, make_env
from m2flow.envs import meshes


def _soup(vertices, faces):
    """A triangle soup as SAPIEN hands parts over: three vertices of its own per triangle."""
    return vertices[faces.reshape(-1)].astype(np.float32), np.arange(faces.size).reshape(-1, 3)


def test_vertex_normals_of_a_hand_worked_tent():
    # two triangles meeting at the ridge x=0: slopes z = 1 - |x|; the ridge vertices average
    # the two slopes' normals (-1, 0, 1)/sqrt2 and (1, 0, 1)/sqrt2 (equal areas) to (0, 0, 1)
    v = np.array([[-1, 0, 0], [0, 0, 1], [0, 1, 1], [1, 0, 0]], np.float32)
    f = np.array([[0, 1, 2], [1, 3, 2]])
    n = meshes.vertex_normals(v, f)
    s = 1 / np.sqrt(2)
    np.testing.assert_allclose(n, [[-s, 0, s], [0, 0, 1], [0, 0, 1], [s, 0, s]], atol=1e-6)


def test_a_sphere_soup_is_decimated_to_the_fraction_and_stays_a_sphere():
    trimesh = pytest.importorskip("trimesh")
    sphere = trimesh.creation.icosphere(subdivisions=4, radius=2.0)  # 5120 triangles
    v, f = _soup(np.asarray(sphere.vertices), np.asarray(sphere.faces))
    v2, f2, n2 = meshes.simplify(v, f, 0.1)
    assert 0.07 * len(f) <= len(f2) <= 0.13 * len(f)
    assert len(v2) < len(v) / 10  # the soup's vertices were merged before collapsing
    radius = np.linalg.norm(v2, axis=1)
    assert np.abs(radius - 2.0).max() < 0.1
    np.testing.assert_allclose(np.linalg.norm(n2, axis=1), 1.0, atol=1e-5)
    assert (np.sum(n2 * v2 / radius[:, None], axis=1) > 0.95).all()  # outward, as the sphere's
    used = np.unique(f2)
    assert used.min() >= 0 and used.max() < len(v2)


# -- the real scene --------------------------------------------------------------------------
def _pushcube(fraction):
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    env = gym.make("PushCube-v1", num_envs=1, sim_backend="physx_cpu", obs_mode="rgb",
                   render_backend="cpu", sensor_configs=dict(width=64, height=64),
                   control_mode="pd_ee_delta_pos")
    if fraction < 1:
        meshes.install(env, fraction)
    return env


def _triangles(env, prefix):
    import sapien

    total = 0
    for entity in env.unwrapped.scene.sub_scenes[0].entities:
        if not entity.name.startswith(prefix):
            continue
        for c in entity.components:
            if isinstance(c, sapien.render.RenderBodyComponent):
                total += sum(p.get_triangles().shape[0]
                             for s in c.render_shapes if hasattr(s, "parts") for p in s.parts)
    return total


def _rgb(obs):
    return obs["sensor_data"]["base_camera"]["rgb"][0].numpy().astype(np.int16)


@pytest.mark.timeout(300)
def test_pushcube_renders_the_arm_lighter_and_looks_the_same():
    full, light = _pushcube(1.0), _pushcube(0.05)
    try:
        n_full, n_light = _triangles(full, "panda"), _triangles(light, "panda")
        assert n_full > 100_000  # the published Panda meshes
        assert n_light < 0.08 * n_full
        assert _triangles(light, "scene-0_cube") == _triangles(full, "scene-0_cube")
        action = np.array([[0.5, 0.2, -0.3, 0.0]], np.float32)
        a, b = _rgb(full.reset(seed=3)[0]), _rgb(light.reset(seed=3)[0])
        for _ in range(5):
            a, b = _rgb(full.step(action)[0]), _rgb(light.step(action)[0])
        diff = np.abs(a - b).mean()
        assert 0 < diff < 4.0, diff  # changed (the arm is simplified), by a few levels of 255
        # physics untouched: the same states after the same actions
        np.testing.assert_allclose(full.unwrapped.agent.tcp.pose.p.numpy(),
                                   light.unwrapped.agent.tcp.pose.p.numpy(), atol=1e-5)
        # a rebuilt scene (ManiSkill's reconfigure) is simplified again
        light.reset(seed=4, options={"reconfigure": True})
        assert _triangles(light, "panda") == n_light
    finally:
        full.close()
        light.close()


@pytest.mark.timeout(300)
def test_make_env_passes_the_fraction_to_its_simulator_processes():
    def obs(fraction):
        env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=2, obs_mode="rgb",
                                  control_mode="pd_ee_delta_pos",
                                  visual_mesh_fraction=fraction))
        try:
            env.reset(seed=[5, 6])
            return env.step(torch.full((2, env.spec.action_dim), 0.3))["next", "obs", "rgb"]
        finally:
            env.close()

    full, light = obs(1.0).to(torch.int16), obs(0.05).to(torch.int16)
    diff = (full - light).abs().float().mean().item()
    assert 0 < diff < 4.0, diff


def test_only_a_cpu_renderer_draws_lighter_meshes(caplog):
    """Seen on the H100 (scripts/gpu_check.sh): a GPU renders the published meshes at ~650 env
    steps/s for 16 envs at 128 px, so the fraction applies to CPU rendering alone."""
    from m2flow.envs.maniskill import _mesh_fraction

    cfg = env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb", visual_mesh_fraction=0.05)
    assert _mesh_fraction(cfg, "cpu") == 0.05
    assert _mesh_fraction(cfg, "none") == 1.0 and not caplog.records
    with caplog.at_level("WARNING"):
        assert _mesh_fraction(cfg, "gpu") == 1.0
    assert "visual_mesh_fraction=0.05 is for CPU rendering" in caplog.text
