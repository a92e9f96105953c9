"""Lighter visual meshes for CPU rendering (``env.visual_mesh_fraction``).

On a CPU, SAPIEN renders through Mesa's software Vulkan (lavapipe), whose cost is the
triangles it draws, not the pixels, and ManiSkill's Panda arm (its published
``franka_description`` meshes) is most of a PushCube camera frame's triangles. Keeping a
fraction of the arm's triangles (quadric decimation, ``fast_simplification``) renders a frame
several times faster and changes the image by a level or two of 255 on average: see
bench/README.md#render_detailpy for the times and the images side by side.

What is simplified: every untextured triangle-mesh part of every body's visual shape with
more than :data:`MIN_TRIANGLES` triangles (the robot's links; boxes, planes and textured
meshes such as the table stay as they are). Collision shapes and physics are untouched: only
what the cameras see changes. The simplified copy of each part is computed once per process
and reused when the scene is rebuilt (a ManiSkill reconfigure).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

MIN_TRIANGLES = 500
"""Parts with fewer triangles are kept as they are (boxes, small parts: nothing to gain)."""
_TEXTURES = ("base_color_texture", "diffuse_texture", "normal_texture", "roughness_texture",
             "metallic_texture", "emission_texture", "transmission_texture")


def simplify(vertices: np.ndarray, triangles: np.ndarray, fraction: float
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mesh with about ``fraction`` of its triangles: (vertices, triangles, vertex normals).

    SAPIEN hands each part over as a triangle soup (three vertices per triangle, none
    shared), which a decimator cannot collapse; equal positions are merged first.
    """
    import fast_simplification

    merged, inverse = np.unique(np.round(vertices.astype(np.float64), 6), axis=0,
                                return_inverse=True)
    faces = inverse.reshape(-1)[triangles.astype(np.int64)]
    faces = faces[(faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2])
                  & (faces[:, 0] != faces[:, 2])]
    v, f = fast_simplification.simplify(merged.astype(np.float32), faces.astype(np.int32),
                                        target_reduction=1.0 - fraction)
    v = np.ascontiguousarray(v, dtype=np.float32)
    f = np.ascontiguousarray(f, dtype=np.uint32)
    return v, f, vertex_normals(v, f)


def vertex_normals(vertices: np.ndarray, triangles: np.ndarray) -> np.ndarray:
    """Unit normals per vertex: the area-weighted sum of its triangles' normals."""
    a, b, c = (vertices[triangles[:, i].astype(np.int64)] for i in range(3))
    face = np.cross(b - a, c - a)  # length = 2 x area: the weighting
    normals = np.zeros_like(vertices, dtype=np.float64)
    for i in range(3):
        np.add.at(normals, triangles[:, i].astype(np.int64), face)
    norm = np.linalg.norm(normals, axis=1, keepdims=True)
    return np.ascontiguousarray(normals / np.where(norm > 0, norm, 1.0), dtype=np.float32)


def _eligible(part) -> bool:
    if part.get_triangles().shape[0] <= MIN_TRIANGLES:
        return False
    material = part.material
    return material is None or all(getattr(material, t, None) is None for t in _TEXTURES)


_MEMO: dict = {}


def _cached(key: tuple, make: Callable) -> tuple:
    """``make()``'s result, computed once per process for ``key``."""
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]


def simplify_scene(scene, fraction: float) -> tuple[int, int]:
    """Replaces, in every sub-scene of a ManiSkill ``scene``, each render body that has an
    eligible part with one whose eligible parts are simplified. Returns the triangles of the
    replaced bodies before and after."""
    import sapien

    before = after = 0
    for sub in scene.sub_scenes:
        for entity in sub.entities:
            for body in list(entity.components):
                if not isinstance(body, sapien.render.RenderBodyComponent):
                    continue
                shapes = list(body.render_shapes)
                if not any(isinstance(s, sapien.render.RenderShapeTriangleMesh)
                           and any(_eligible(p) for p in s.parts) for s in shapes):
                    continue
                new = sapien.render.RenderBodyComponent()
                new.name = body.name
                for shape in shapes:
                    if not isinstance(shape, sapien.render.RenderShapeTriangleMesh):
                        new.attach(shape.clone())
                        continue
                    for i, part in enumerate(shape.parts):
                        b, a = _attach_part(new, shape, i, part, fraction)
                        before, after = before + b, after + a
                new.visibility = body.visibility
                entity.remove_component(body)
                entity.add_component(new)
    return before, after


def _attach_part(body, shape, index: int, part, fraction: float) -> tuple[int, int]:
    import sapien

    v, f = part.get_vertices(), part.get_triangles()
    if _eligible(part):
        key = (shape.filename, index, v.shape[0], f.shape[0], float(fraction))
        v2, f2, n2 = _cached(key, functools.partial(simplify, v, f, fraction))
        uv = np.zeros((v2.shape[0], 2), np.float32)  # untextured: no coordinates to keep
    else:
        v2, f2, n2, uv = v, f, part.get_vertex_normal(), part.get_vertex_uv()
    mesh = sapien.render.RenderShapeTriangleMesh(
        np.ascontiguousarray(v2, np.float32), np.ascontiguousarray(f2, np.uint32),
        np.ascontiguousarray(n2, np.float32), np.ascontiguousarray(uv, np.float32),
        part.material)
    mesh.set_local_pose(shape.local_pose)
    mesh.set_scale(shape.scale)
    mesh.set_front_face(shape.front_face)
    mesh.name = shape.name
    body.attach(mesh)
    return f.shape[0], f2.shape[0]


def install(env, fraction: float) -> tuple[int, int]:
    """Simplifies the built scene of a ManiSkill env (``env.unwrapped``) now and after every
    rebuild (reconfigure). Returns the triangles before and after, as :func:`simplify_scene`."""
    base = env.unwrapped
    counts = simplify_scene(base.scene, fraction)
    rebuild = base._reconfigure

    def reconfigure(*args, **kwargs):
        out = rebuild(*args, **kwargs)
        simplify_scene(base.scene, fraction)
        return out

    base._reconfigure = reconfigure  # reset(options={"reconfigure": True}) rebuilds the scene
    return counts
