#!/usr/bin/env bash
# Rehearses the GPU check's three calls here, on the CPU, before a GPU machine is lent: a kit for
# this machine's Python (cp311; scripts/device_kit.sh with KIT_PYTHON), a stand-in for the GPU
# machine's image (a venv that sees only the packages that image has: torch, transformers,
# timm, peft, numpy, tensorboard, pytest, ...; the list of /work/.library/device/KINDS.md, as
# of 2026-11-17, in IMAGE below, linked from .venv with what they require; opencv-python
# stands in for the image's opencv-python-headless, the same cv2), then gpu_check.sh's call1, call2 and
# call3 with REHEARSE=cpu: the kit unpacked piece by piece, every step at a small size. What a
# step imports that neither the image nor the kit holds fails here as it would there.
#   bash scripts/gpu_rehearse.sh [OUT_DIR]          (~10 minutes; the kit build ~5 of them)
#   REUSE_KIT=1 bash scripts/gpu_rehearse.sh        (the kit built by the last rehearsal)
# Warp's CPU compiler, which the device kit leaves behind (the GPU compiles with NVRTC), is
# linked in from .venv so that mjlab's kernels compile here.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu_rehearsal}
ROOT=/tmp/gpu_rehearse
KIT=$ROOT/kit
PYV=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
IMAGE="torch transformers timm peft numpy safetensors tokenizers huggingface-hub hf-xet
  tensorboard tensorboard-data-server pytest pytest-timeout pluggy iniconfig packaging pyyaml
  regex requests urllib3 idna certifi charset-normalizer tqdm filelock fsspec jinja2 markupsafe
  sympy mpmath networkx typing-extensions pillow psutil protobuf grpcio absl-py markdown
  werkzeug scipy matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil
  six click rich markdown-it-py mdurl pygments msgpack aiohttp aiosignal frozenlist multidict
  yarl propcache attrs aiohappyeyeballs opencv-python-headless imageio lxml einops
  accelerate cloudpickle setuptools triton xxhash h5py pandas anyio httpx httpcore h11 onnx
  opencv-python $(.venv/bin/python -c 'import importlib.metadata as m
print(" ".join(d.metadata["Name"] for d in m.distributions() if d.metadata["Name"].startswith("nvidia-")))')"

mkdir -p "$ROOT" && find "$ROOT" -mindepth 1 -maxdepth 1 ! -name kit -exec rm -rf {} +
rm -rf "$OUT" && mkdir -p "$OUT"
if [ -n "${REUSE_KIT:-}" ] && [ -f "$KIT/parts.tsv" ]; then
  echo "== the kit for Python $PYV: $KIT as built before (REUSE_KIT)"
else
  echo "== the kit for Python $PYV (into $KIT)"
  rm -rf "$KIT"
  KIT_PYTHON=$PYV KIT=$KIT bash scripts/device_kit.sh > "$ROOT/kit_build.log" 2>&1 \
    || { tail -20 "$ROOT/kit_build.log"; exit 1; }
fi
cat "$KIT/calls.txt"

echo "== the image's stand-in: a venv seeing only IMAGE's packages"
"$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')/bin/python$PYV" -m venv --without-pip "$ROOT/image"
.venv/bin/python - "$ROOT/image" $IMAGE <<'PY'
import importlib.metadata as m, pathlib, sys, sysconfig
from packaging.requirements import Requirement
image = pathlib.Path(sys.argv[1])
dest = next(image.glob("lib/python*/site-packages"))
src = pathlib.Path(sysconfig.get_paths()["purelib"])
# the image is a consistent environment: what its packages require is there too (linked here
# in .venv's versions, as those packages are)
names, missing, todo = set(), [], list(sys.argv[2:])
while todo:
    name = todo.pop()
    key = name.lower().replace("_", "-")
    if key in names:
        continue
    names.add(key)
    try:
        dist = m.distribution(name)
    except m.PackageNotFoundError:
        missing.append(name)
        continue
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
for name in sorted(names):
    try:
        dist = m.distribution(name)
    except m.PackageNotFoundError:
        continue
    tops = {pathlib.Path(str(f)).parts[0] for f in dist.files or []}
    for top in tops:
        if top.endswith(".pth") or top == ".." or not (src / top).exists():
            continue
        link = dest / top
        if not link.exists():
            link.symlink_to(src / top)
print(f"image: {len(names) - len(missing)} packages linked"
      + (f"; not in .venv: {' '.join(missing)}" if missing else ""))
PY
PY_IMG=$ROOT/image/bin/python
WARP_CLANG=$(.venv/bin/python -c 'import warp, os; print(os.path.dirname(warp.__file__))')/bin/warp-clang.so

for c in 1 2 3; do
  echo "== call$c"
  # what the device call carries: the tree, parts.tsv and this call's piece; the warm machine
  # keeps /tmp (here: $ROOT) between calls
  rm -rf "$ROOT/carry" && mkdir -p "$ROOT/carry"
  cp "$KIT/parts.tsv" "$KIT/kit.$((c - 1))" "$ROOT/carry/"
  REHEARSE=cpu PYTHON=$PY_IMG KIT=$ROOT/carry SITE=$ROOT/site PIECES=$ROOT/pieces \
    REHEARSE_WARP_CLANG=$WARP_CLANG bash scripts/gpu_check.sh "$OUT/call$c" "call$c"
done
echo "== rehearsal: $OUT/call{1,2,3}/summary.txt"
cat "$OUT"/call*/summary.txt
