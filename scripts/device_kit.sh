#!/usr/bin/env bash
# Builds, on a machine that reaches PyPI and Debian (after scripts/install.sh), what the GPU
# check (scripts/gpu_check.sh) installs on a GPU machine that has Python 3.12, torch,
# transformers, timm and peft but no network. Four parts, in the order the check needs them:
#   core       what every step imports that the machine lacks: Hydra, OmegaConf, tensordict,
#              gymnasium, math_verify, MuJoCo (a cp312 wheel, without its headers and Studio
#              UI), trimesh and the others mjlab imports (pure-Python ones copied from .venv)
#   mjlab      mjlab and MuJoCo Warp (see mjlab_part below; Warp's library is most of it)
#   ray        Ray (the version installed here, a cp312 wheel) without its Java jars, dashboard
#              front end and the libraries m2flow does not use (rllib, tune, train, serve,
#              data, llm, air); beside it, Ray's own dependencies as unpacked wheels
#              (gpu_check.sh installs those the machine lacks)
#   maniskill  SAPIEN (without C++ headers and CUDA denoiser), ManiSkill trimmed to the Panda
#              (no other robots, no environment maps), fast_simplification, the kinematics
#              packages
# Each part is a .tar.xz; together they are one stream (.kit/parts.tsv: name, offset, size,
# sha256) cut into pieces .kit/kit.0, .kit/kit.1, ... of LOAD (59) MiB, one per device call
# (a call carries at most 64 MiB; the working tree adds ~3). gpu_check.sh keeps the pieces
# under /tmp/kit_pieces and unpacks each part once its bytes have all arrived: core and mjlab
# after the second call, so that the Lift-Cube step runs in it. .kit/calls.txt lists the calls.
#   .gl/*.deb  the Vulkan/EGL/GL loader libraries (Debian) the NVIDIA driver needs
# Both folders are git-ignored; hand them to the GPU machine with the working tree.
# Not in the kit: SAPIEN's GPU PhysX library, which SAPIEN downloads from GitHub at first use
# (this machine reaches only PyPI and Debian; the one PyPI package holding a libPhysXGpu_64.so,
# Isaac Sim's 246 MB physics cache, is PhysX 5.6, not the 5.3.1 SAPIEN 3.0 loads): ManiSkill's
# GPU simulation cannot run there.
#   bash scripts/device_kit.sh [core] [mjlab] [ray] [maniskill] [pack]  (default: all, then pack)
#   KIT_PYTHON=3.11 KIT=/tmp/kit311 bash scripts/device_kit.sh   (a kit for this machine's
#       Python, to rehearse the install and the steps here: scripts/gpu_rehearse.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
KIT=${KIT:-.kit}
PARTS=${*:-core mjlab ray maniskill pack}
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
# train.py) that neither the GPU machine's image nor the core part holds. Left behind: Warp's CPU
# compiler (warp-clang.so, 69 MB; Warp loads it only where present, and the GPU machine compiles
# kernels for CUDA), ffmpeg's binary (imageio-ffmpeg fetches it on first use, mediapy only for
# videos), wandb's service binary (a run with logger=tensorboard starts none) and the G1 and Go1
# meshes (their XML stays: mjlab asserts it at import; those robots' tasks cannot be built).
MJLAB_DISTS="mjlab mujoco-warp warp-lang rsl-rl-lib wandb viser mjviser mediapy imageio-ffmpeg
  tyro docstring-parser typeguard msgspec prettytable wcwidth gitpython gitdb smmap pydantic
  pydantic-core typing-inspection annotated-types platformdirs websockets zstandard pyopengl
  cffi pycparser googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-proto
  opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport
  opentelemetry-exporter-otlp-common"
mjlab_part() {
  rm -rf "$KIT/mjlab" "$KIT/mjlab.tar.xz" && mkdir -p "$KIT/mjlab/whl" "$KIT/mjlab/site"
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
  part_done mjlab
}
part_done() {  # NAME: the size of .kit/NAME.tar.xz
  local size; size=$(stat -c %s "$KIT/$1.tar.xz")
  echo "device_kit: $KIT/$1.tar.xz $((size / 1048576)) MiB"
}
copy_pure() {  # DIR MODULE...: pure-Python packages copied from this venv, with their dist-info
  local dir=$1 mod dist; shift
  for mod in "$@"; do
    [ -e "$SP/$mod" ] || { echo "device_kit: $mod is not installed in .venv (run scripts/install.sh)"; exit 1; }
    cp -r "$SP/$mod" "$dir/"
    dist=$(.venv/bin/python -c "import importlib.metadata as m
print(next(iter(m.packages_distributions()['$mod'])))")
    cp -r "$SP"/$(echo "$dist" | tr '-' '_')-[0-9]*.dist-info "$dir/" 2>/dev/null \
      || cp -r "$SP"/"$dist"-[0-9]*.dist-info "$dir/" 2>/dev/null \
      || cp -r "$SP"/$(echo "$dist" | tr 'A-Z-' 'a-z_')-[0-9]*.dist-info "$dir/"
  done
}
wheels() {  # DIR REQUIREMENT...: cp$PYV wheels unpacked into DIR/site
  mkdir -p "$1/whl" "$1/site"
  download "$1/whl" --no-deps "${@:2}"
  for w in "$1"/whl/*.whl; do .venv/bin/python -m zipfile -e "$w" "$1/site"; done
  rm -rf "$1/whl"
}
core_part() {
  rm -rf "$KIT/core" "$KIT/core.tar.xz"
  wheels "$KIT/core" "mujoco==$(ver mujoco)"
  # MuJoCo: no C headers, no experimental Studio UI (28 MB; nothing m2flow runs imports it)
  rm -rf "$KIT/core/site/mujoco/include" "$KIT/core/site/mujoco/experimental"
  copy_pure "$KIT/core/site" antlr4 hydra omegaconf tensordict pyvers gymnasium \
    farama_notifications dacite trimesh glfw IPython traitlets math_verify latex2sympy2_extended \
    defusedxml
  find "$KIT/core" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$KIT/core" -cJf "$KIT/core.tar.xz" site && rm -rf "$KIT/core"
  part_done core
}
maniskill_part() {
  rm -rf "$KIT/maniskill" "$KIT/maniskill.tar.xz"
  wheels "$KIT/maniskill" "sapien==$(ver sapien)" "fast_simplification==$(ver fast_simplification)"
  local site="$KIT/maniskill/site"
  # SAPIEN: no C++ headers, no CUDA denoiser device (its denoiser core stays: pysapien links it)
  rm -rf "$site/sapien/include" "$site"/sapien/oidn_library/*device_cuda*
  copy_pure "$site" transforms3d pytorch_kinematics pytorch_seed arm_pytorch_utilities mani_skill
  # ManiSkill: the Panda only (its URDFs and franka_description); no scene map, no examples' videos
  local robots="$site/mani_skill/assets/robots"
  find "$robots" -mindepth 1 -maxdepth 1 ! -name panda -exec rm -rf {} +
  rm -rf "$robots/panda/realsense2_description" "$robots/panda/sciurus17_description" \
    "$site/mani_skill/assets/environment_maps" "$site/mani_skill/assets/maniskill2-scene-2.glb" \
    "$site"/mani_skill/utils/scene_builder/replicacad/*.hdr
  find "$KIT/maniskill" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$KIT/maniskill" -cJf "$KIT/maniskill.tar.xz" site && rm -rf "$KIT/maniskill"
  part_done maniskill
}
gl_part() {  # the loaders (as the device README says: amd64 debs, unpacked there with dpkg -x)
  mkdir -p .gl /tmp/amd64/partial
  local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
    apt-get $o update -qq
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
  fi
}
pack() {  # the parts as one stream cut into pieces of one call each; parts.tsv; calls.txt
  .venv/bin/python - "$KIT" "${LOAD:-59}" <<'PY'
import hashlib, os, sys
kit, load = sys.argv[1], int(sys.argv[2]) << 20
order = ["core", "mjlab", "ray", "maniskill"]  # what the calls' steps need first comes first
for f in os.listdir(kit):
    if f.startswith("kit.") and f[4:].isdigit():
        os.remove(f"{kit}/{f}")
stream, rows = b"", []
for name in order:
    data = open(f"{kit}/{name}.tar.xz", "rb").read()
    rows.append((name, len(stream), len(data), hashlib.sha256(data).hexdigest()))
    stream += data
with open(f"{kit}/parts.tsv", "w") as f:
    f.write(f"piece_bytes\t{load}\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))
pieces = [stream[i:i + load] for i in range(0, len(stream), load)]
for i, p in enumerate(pieces):
    open(f"{kit}/kit.{i}", "wb").write(p)
with open(f"{kit}/calls.txt", "w") as f:
    for i, p in enumerate(pieces):
        ready = [n for n, off, size, _ in rows if i * load < off + size <= (i + 1) * load]
        carry = [".kit/parts.tsv", f".kit/kit.{i}"] + ([".gl"] if i == 0 else [])
        f.write(f"call {i + 1} ({len(p) / 2**20:.0f} MiB): carry {carry}; "
                f"completes {', '.join(ready) or 'nothing'}\n")
print(f"device_kit: {len(stream) / 2**20:.0f} MiB in {len(pieces)} pieces of at most "
      f"{load >> 20} MiB")
PY
  cat "$KIT/calls.txt"
}
for part in core mjlab ray maniskill; do
  case " $PARTS " in *" $part "*) "${part}_part" ;; esac
done
case " $PARTS " in *" core "*|*" maniskill "*) gl_part ;; esac
case " $PARTS " in *" pack "*) pack ;; esac
du -ch "$KIT" .gl 2>/dev/null | tail -1 || true
