#!/usr/bin/env bash
# Builds, on a machine that reaches PyPI and Debian (after scripts/install.sh), what the GPU
# check (scripts/gpu_check.sh) installs on a GPU machine that has Python 3.12, torch,
# transformers, timm and peft but no network:
#   .kit/site.tar.xz   the packages m2flow needs there that it lacks (sapien, mujoco and
#                      fast_simplification as cp312 wheels; the pure-Python ones copied from
#                      .venv), ManiSkill trimmed to the Panda (no other robots, no environment
#                      maps), SAPIEN without C++ headers and CUDA denoiser: 51 MiB, checked to
#                      be under 56 MiB (a device call carries at most 64 MiB)
#   .gl/*.deb          the Vulkan/EGL/GL loader libraries (Debian) the NVIDIA driver needs
# Both folders are git-ignored; hand them to the GPU machine with the working tree.
# Not in the kit: Ray (79 MB; the check runs without it, cluster=gpu_inprocess) and SAPIEN's
# GPU PhysX library, which SAPIEN downloads from GitHub at first use (this machine reaches only
# PyPI and Debian): ManiSkill's GPU simulation cannot run there.
#   bash scripts/device_kit.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
KIT=.kit
rm -rf "$KIT" && mkdir -p "$KIT/site" "$KIT/whl"

# 1. compiled packages: cp312 manylinux wheels, the versions installed here
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
plat=""
for n in 17 24 27 28 31 34 35; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $plat --platform manylinux2014_x86_64 -d "$KIT/whl" \
  "sapien==$(ver sapien)" "mujoco==$(ver mujoco)" \
  "fast_simplification==$(ver fast_simplification)" 2>&1 | grep -v "^WARNING: Location" || true
for w in "$KIT"/whl/*.whl; do
  .venv/bin/python -m zipfile -e "$w" "$KIT/site"
done
# SAPIEN: no C++ headers, no CUDA denoiser device (its denoiser core stays: pysapien links it)
rm -rf "$KIT/whl" "$KIT/site/sapien/include" "$KIT"/site/sapien/oidn_library/*device_cuda*

# 2. pure-Python packages the GPU machine lacks: copied from this venv (with their dist-info)
pure="antlr4 hydra omegaconf tensordict pyvers gymnasium farama_notifications dacite
      transforms3d trimesh pytorch_kinematics pytorch_seed arm_pytorch_utilities glfw IPython
      traitlets math_verify latex2sympy2_extended defusedxml mani_skill"
for mod in $pure; do
  [ -e "$SP/$mod" ] || { echo "device_kit: $mod is not installed in .venv (run scripts/install.sh)"; exit 1; }
  cp -r "$SP/$mod" "$KIT/site/"
  dist=$(.venv/bin/python -c "
import importlib.metadata as m
print(next(iter(m.packages_distributions()['$mod'])))")
  cp -r "$SP"/$(echo "$dist" | tr '-' '_')-[0-9]*.dist-info "$KIT/site/" 2>/dev/null \
    || cp -r "$SP"/"$dist"-[0-9]*.dist-info "$KIT/site/" 2>/dev/null \
    || cp -r "$SP"/$(echo "$dist" | tr 'A-Z-' 'a-z_')-[0-9]*.dist-info "$KIT/site/"
done
# ManiSkill: the Panda only (its URDFs and franka_description); no scene map, no examples' videos
robots="$KIT/site/mani_skill/assets/robots"
find "$robots" -mindepth 1 -maxdepth 1 ! -name panda -exec rm -rf {} +
rm -rf "$robots/panda/realsense2_description" "$robots/panda/sciurus17_description" \
  "$KIT/site/mani_skill/assets/environment_maps" "$KIT/site/mani_skill/assets/maniskill2-scene-2.glb" \
  "$KIT"/site/mani_skill/utils/scene_builder/replicacad/*.hdr
find "$KIT/site" -name __pycache__ -prune -exec rm -rf {} +

tar -C "$KIT" -cJf "$KIT/site.tar.xz" site
rm -rf "$KIT/site"
size=$(stat -c %s "$KIT/site.tar.xz")
echo "device_kit: $KIT/site.tar.xz $((size / 1048576)) MiB"
[ "$size" -lt $((56 * 1048576)) ] || { echo "device_kit: the kit is over 56 MiB"; exit 1; }

# 3. the loaders (as the device README says: amd64 debs, unpacked there with dpkg -x)
mkdir -p .gl /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
  apt-get $o update -qq
  (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi
du -ch "$KIT" .gl | tail -1
