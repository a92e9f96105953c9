#!/usr/bin/env bash
# Builds, on a machine that reaches PyPI and Debian (after scripts/install.sh), what the GPU
# check (scripts/gpu_check.sh) installs on a GPU machine that has Python 3.12, torch,
# transformers, timm and peft but no network:
#   .kit/site.tar.xz   the packages m2flow needs there that it lacks (sapien, mujoco and
#                      fast_simplification as cp312 wheels; the pure-Python ones copied from
#                      .venv), ManiSkill trimmed to the Panda (no other robots, no environment
#                      maps), SAPIEN without C++ headers and CUDA denoiser, MuJoCo without
#                      its Studio UI: 52 MiB, checked to be under 56 MiB (a device call
#                      carries at most 64 MiB)
#   .kit/ray.tar.xz    Ray (the version installed here, as a cp312 wheel) without its Java jars,
#                      dashboard front end and libraries m2flow does not use (rllib, tune,
#                      train, serve, data, llm, air): 29 MiB; beside it, Ray's own dependencies
#                      as unpacked wheels (gpu_check.sh installs those the machine lacks)
#   .gl/*.deb          the Vulkan/EGL/GL loader libraries (Debian) the NVIDIA driver needs
#   .kit/mjlab.tar.xz.{0,1,2}  mjlab and MuJoCo Warp (see mjlab_part below)
# Both folders are git-ignored; hand them to the GPU machine with the working tree. The parts do
# not fit in one device call (64 MiB): .kit/calls.txt lists three calls that only unpack
# (gpu_check.sh OUT unpack), after which a call carrying nothing runs the check.
# Not in the kit: SAPIEN's GPU PhysX library, which SAPIEN downloads from GitHub at first use
# (this machine reaches only PyPI and Debian; the one PyPI package holding a libPhysXGpu_64.so,
# Isaac Sim's 246 MB physics cache, is PhysX 5.6, not the 5.3.1 SAPIEN 3.0 loads): ManiSkill's
# GPU simulation cannot run there.
#   bash scripts/device_kit.sh [site] [ray] [mjlab]      (default: all three)
#   KIT_PYTHON=3.11 bash scripts/device_kit.sh ray   (a Ray part for this machine's Python, to
#                                                      try the trimmed Ray here)
set -euo pipefail
cd "$(dirname "$0")/.."
SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
KIT=.kit
PARTS=${*:-site ray mjlab}
PYV=${KIT_PYTHON:-3.12}
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
plat=""
for n in 17 24 27 28 31 34 35; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
download() {  # download DIR [--no-deps] REQUIREMENT...: cp$PYV manylinux wheels
  local dir=$1; shift
  .venv/bin/python -m pip download -q --only-binary=:all: --python-version "$PYV" \
    --implementation cp $plat --platform manylinux2014_x86_64 -d "$dir" "$@" 2>&1 \
    | grep -v "^WARNING: Location" || true
}
unzip_keep_modes() {  # WHEEL DIR: unpacks with the files' permissions (Ray's daemons are executables)
  .venv/bin/python - "$1" "$2" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for i in z.infolist():
        path = z.extract(i, sys.argv[2])
        mode = (i.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
}
mkdir -p "$KIT"

ray_part() {
  rm -rf "$KIT/ray" "$KIT/ray.tar.xz" && mkdir -p "$KIT/ray/whl" "$KIT/ray/site" "$KIT/ray/deps"
  download "$KIT/ray/whl" "ray==$(ver ray)"
  for w in "$KIT"/ray/whl/*.whl; do
    case $(basename "$w") in
      ray-*) unzip_keep_modes "$w" "$KIT/ray/site" ;;
      *) d="$KIT/ray/deps/$(basename "$w" | cut -d- -f1)"; unzip_keep_modes "$w" "$d" ;;
    esac
  done
  rm -rf "$KIT/ray/whl"
  (cd "$KIT/ray/site/ray" && rm -rf jars dashboard/client rllib tune train serve data llm air \
    workflow cpp)
  find "$KIT/ray" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$KIT/ray" -cJf "$KIT/ray.tar.xz" site deps
  rm -rf "$KIT/ray"
  local size; size=$(stat -c %s "$KIT/ray.tar.xz")
  echo "device_kit: $KIT/ray.tar.xz $((size / 1048576)) MiB (Ray $(ver ray), cp${PYV/./})"
  [ "$size" -lt $((56 * 1048576)) ] || { echo "device_kit: the Ray part is over 56 MiB"; exit 1; }
}
# mjlab and MuJoCo Warp, with what they import (in a Lift-Cube training by m2flow or by mjlab's
# train.py) that neither the GPU machine's image nor the site kit holds. Left behind: Warp's CPU
# compiler (warp-clang.so, 69 MB; Warp loads it only where present, and the GPU machine compiles
# kernels for CUDA), ffmpeg's binary (imageio-ffmpeg fetches it on first use, mediapy only for
# videos), wandb's service binary (a run with logger=tensorboard starts none) and the G1 and Go1
# meshes (their XML stays: mjlab asserts it at import; those robots' tasks cannot be built).
# Warp's library alone is 81 MiB compressed, so the whole does not fit one call. The three
# parts travel in three calls of at most LOAD (59) MiB each (the working tree adds ~3 MiB):
#   1: .kit/ray.tar.xz  + .kit/mjlab.tar.xz.0 (LOAD minus Ray)
#   2: .kit/site.tar.xz + .kit/mjlab.tar.xz.1 (LOAD minus the site kit) + .gl
#   3: .kit/mjlab.tar.xz.2 (the rest)
# each with .kit/mjlab.sha256; gpu_check.sh keeps the pieces under /tmp/kit_pieces and unpacks
# the whole once its checksum matches. .kit/calls.txt lists the three carries.
MJLAB_DISTS="mjlab mujoco-warp warp-lang rsl-rl-lib wandb viser mjviser mediapy imageio-ffmpeg
  tyro docstring-parser typeguard msgspec prettytable wcwidth gitpython gitdb smmap pydantic
  pydantic-core typing-inspection annotated-types platformdirs websockets zstandard pyopengl
  cffi pycparser googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-proto
  opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport
  opentelemetry-exporter-otlp-common"
mjlab_part() {
  rm -rf "$KIT/mjlab" "$KIT"/mjlab.tar.xz* "$KIT/mjlab.sha256" && mkdir -p "$KIT/mjlab/whl" "$KIT/mjlab/site"
  local reqs=() d
  for d in $MJLAB_DISTS; do reqs+=("$d==$(ver "$d")"); done
  download "$KIT/mjlab/whl" --no-deps "${reqs[@]}"
  for w in "$KIT"/mjlab/whl/*.whl; do .venv/bin/python -m zipfile -e "$w" "$KIT/mjlab/site"; done
  rm -rf "$KIT/mjlab/whl"
  (cd "$KIT/mjlab/site" && rm -rf warp/bin/warp-clang.so warp/tests warp/examples \
    imageio_ffmpeg/binaries/* wandb/bin mjlab/asset_zoo/robots/unitree_{g1,go1}/xmls/assets)
  find "$KIT/mjlab" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$KIT/mjlab" -cf - site | xz -T2 -6 > "$KIT/mjlab.tar.xz"
  rm -rf "$KIT/mjlab"
  (cd "$KIT" && sha256sum mjlab.tar.xz > mjlab.sha256)
  mjlab_split
}
mjlab_split() {  # the pieces of .kit/mjlab.tar.xz, by the sizes of the other parts (PARTS: split)
  [ -f "$KIT/ray.tar.xz" ] && [ -f "$KIT/site.tar.xz" ] \
    || { echo "device_kit: build the ray and site parts first (their sizes set the pieces)"; exit 1; }
  .venv/bin/python - "$KIT" "${LOAD:-59}" <<'PY'
import os, sys
kit, load = sys.argv[1], int(sys.argv[2]) << 20
whole = open(f"{kit}/mjlab.tar.xz", "rb").read()
sizes = [load - os.path.getsize(f"{kit}/ray.tar.xz"), load - os.path.getsize(f"{kit}/site.tar.xz")]
pieces = [whole[:sizes[0]], whole[sizes[0]:sizes[0] + sizes[1]], whole[sizes[0] + sizes[1]:]]
if len(pieces[2]) > load:
    sys.exit(f"device_kit: the mjlab part is {len(whole) >> 20} MiB, over three calls of {load >> 20} MiB")
for i, p in enumerate(pieces):
    open(f"{kit}/mjlab.tar.xz.{i}", "wb").write(p)
os.remove(f"{kit}/mjlab.tar.xz")
calls = [[".kit/ray.tar.xz", ".kit/mjlab.tar.xz.0"],
         [".kit/site.tar.xz", ".kit/mjlab.tar.xz.1", ".gl"], [".kit/mjlab.tar.xz.2"]]
with open(f"{kit}/calls.txt", "w") as f:
    for i, c in enumerate(calls, 1):
        mib = sum(os.path.getsize(x) for x in c if os.path.isfile(x)) / 2**20
        f.write(f"call {i} ({mib:.0f} MiB): carry {c + ['.kit/mjlab.sha256']}, "
                f"command: bash scripts/gpu_check.sh $OUT unpack\n")
PY
  echo "device_kit: .kit/mjlab.tar.xz.{0,1,2} (mjlab $(ver mjlab), Warp $(ver warp-lang)); the calls:"
  cat "$KIT/calls.txt"
}
site_part() {
  rm -rf "$KIT/site" "$KIT/whl" "$KIT/site.tar.xz" && mkdir -p "$KIT/site" "$KIT/whl"

  # 1. compiled packages: cp312 manylinux wheels, the versions installed here
  download "$KIT/whl" --no-deps "sapien==$(ver sapien)" "mujoco==$(ver mujoco)" \
    "fast_simplification==$(ver fast_simplification)"
  for w in "$KIT"/whl/*.whl; do
    .venv/bin/python -m zipfile -e "$w" "$KIT/site"
  done
  # SAPIEN: no C++ headers, no CUDA denoiser device (its denoiser core stays: pysapien links it);
  # MuJoCo: no C headers, no experimental Studio UI (28 MB; nothing m2flow runs imports it)
  rm -rf "$KIT/whl" "$KIT/site/sapien/include" "$KIT"/site/sapien/oidn_library/*device_cuda* \
    "$KIT/site/mujoco/include" "$KIT/site/mujoco/experimental"

  # 2. pure-Python packages the GPU machine lacks: copied from this venv (with their dist-info)
  pure="antlr4 hydra omegaconf tensordict pyvers gymnasium farama_notifications dacite
        transforms3d trimesh pytorch_kinematics pytorch_seed arm_pytorch_utilities glfw IPython
        traitlets math_verify latex2sympy2_extended defusedxml mani_skill"
  for mod in $pure; do
    [ -e "$SP/$mod" ] || { echo "device_kit: $mod is not installed in .venv (run scripts/install.sh)"; exit 1; }
    cp -r "$SP/$mod" "$KIT/site/"
    dist=$(.venv/bin/python -c "import importlib.metadata as m
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
  local size; size=$(stat -c %s "$KIT/site.tar.xz")
  echo "device_kit: $KIT/site.tar.xz $((size / 1048576)) MiB"
  [ "$size" -lt $((56 * 1048576)) ] || { echo "device_kit: the kit is over 56 MiB"; exit 1; }

  # 3. the loaders (as the device README says: amd64 debs, unpacked there with dpkg -x)
  mkdir -p .gl /tmp/amd64/partial
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
    apt-get $o update -qq
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
  fi
}
case " $PARTS " in *" ray "*) ray_part ;; esac
case " $PARTS " in *" site "*) site_part ;; esac
case " $PARTS " in *" mjlab "*) mjlab_part ;; *" split "*) mjlab_split ;; esac
du -ch "$KIT" .gl 2>/dev/null | tail -1
