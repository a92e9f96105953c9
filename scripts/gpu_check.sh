#!/usr/bin/env bash
# The GPU check, in one command on a CUDA machine without network (Python 3.12 with torch,
# transformers, timm and peft installed) that has this repository with .kit/ and .gl/ from
# scripts/device_kit.sh beside it:
#   bash scripts/gpu_check.sh OUT_DIR [STEP ...]
# Installs the kit under /tmp/site and the loader libraries, then runs each step with its own
# time limit (a failing step does not stop the others): pytest -m gpu, the full-size VLAs in
# bf16, the context switch, GPU rendering, GPU PhysX, pipelined collection on the GPU, and GRPO
# with a Qwen2.5-0.5B-shaped model. Writes OUT_DIR/<step>.log, OUT_DIR/results.jsonl and
# OUT_DIR/summary.txt (one line per step: status, seconds), the step logs packed into
# OUT_DIR/logs.tgz. Whole run: ~5 minutes on an H100 (at most 10). The mjlab steps (mjlab_env,
# mjlab_lift, mjlab_pipeline) run only when named, after the mjlab part is unpacked (see
# scripts/device_kit.sh and bench/README.md#the-gpu-check).
# With Ray: the site kit and .kit/ray.tar.xz do not fit in one device call (64 MiB), so a
# first call carries only .kit/ray.tar.xz and unpacks it (STEP `unpack` runs nothing else),
# and the next call, within the ~30 s the machine stays warm, carries .kit/site.tar.xz and .gl
# and runs the check: where Ray is there, pytest -m gpu runs its Ray tests too and the steps
# ray_embodied / ray_reasoning place Ray actors on the GPU (cluster=gpu_collocated,
# reasoning_collocated_gpu); without it they are skipped, saying so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_check.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$OUT"
STEPS=${*:-"env vla_oft vla_oft_ckpt pi0 context_switch physx render reasoning pytest ray_embodied ray_reasoning pipeline plan_gpu vla_openvla"}
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 MUJOCO_GL=egl TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}

if [ ! -d /tmp/site/mani_skill ] && [ -f .kit/site.tar.xz ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  mkdir -p /tmp && tar -C /tmp -xJf .kit/site.tar.xz
fi
if [ ! -d /tmp/site/ray ] && [ -f .kit/ray.tar.xz ]; then
  # Ray itself, and those of its dependencies this Python does not have (a copy of one it has
  # would shadow it for torch and transformers too)
  rm -rf /tmp/ray_kit && mkdir -p /tmp/ray_kit /tmp/site && tar -C /tmp/ray_kit -xJf .kit/ray.tar.xz
  cp -a /tmp/ray_kit/site/. /tmp/site/
  $PY - /tmp/ray_kit/deps /tmp/site <<'PY' | tee -a "$OUT/ray_install.log"
import importlib.metadata as m, pathlib, shutil, sys
deps, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for d in sorted(deps.iterdir()):
    info = next(d.glob("*.dist-info"))
    name = m.Distribution.at(info).metadata["Name"]
    try:
        print(f"ray dependency {name}: {m.version(name)} installed, kept")
    except m.PackageNotFoundError:
        shutil.copytree(d, site, dirs_exist_ok=True)
        print(f"ray dependency {name}: {m.Distribution.at(info).version} from the kit")
PY
  rm -rf /tmp/ray_kit
fi
# mjlab and MuJoCo Warp: pieces carried over several calls (.kit/calls.txt), kept under
# /tmp/kit_pieces, unpacked once their checksum matches .kit/mjlab.sha256
if [ ! -d /tmp/site/mjlab ] && [ -f .kit/mjlab.sha256 ]; then
  mkdir -p /tmp/kit_pieces /tmp/site
  cp .kit/mjlab.sha256 /tmp/kit_pieces/
  for f in .kit/mjlab.tar.xz.[0-9]; do [ -f "$f" ] && cp "$f" /tmp/kit_pieces/; done
  if (cd /tmp/kit_pieces && cat mjlab.tar.xz.[0-9] 2>/dev/null | sha256sum | cut -d' ' -f1 \
      | grep -qx "$(cut -d' ' -f1 mjlab.sha256)"); then
    cat /tmp/kit_pieces/mjlab.tar.xz.[0-9] | tar -C /tmp -xJf - && rm -rf /tmp/kit_pieces
    echo "mjlab part: unpacked into /tmp/site" | tee -a "$OUT/mjlab_install.log"
  else
    echo "mjlab part: pieces here: $(cd /tmp/kit_pieces && ls mjlab.tar.xz.[0-9] 2>/dev/null | tr '\n' ' ')(waiting for the rest)" \
      | tee -a "$OUT/mjlab_install.log"
  fi
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the NVIDIA driver's Vulkan/EGL manifests, where the machine keeps them
for f in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
         /etc/vulkan/icd.d/nvidia_icd.json; do
  [ -f "$f" ] && { export VK_DRIVER_FILES=$f VK_ICD_FILENAMES=$f; break; }
done
for f in /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json /usr/share/glvnd/egl_vendor.d/10_nvidia.json; do
  [ -f "$f" ] && { export __EGL_VENDOR_LIBRARY_FILENAMES=$f; break; }
done

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 t0 rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  echo "== $name (limit ${limit}s)"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local status=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="timed out"
  [ $rc -ne 0 ] && [ "$status" = ok ] && status="failed (rc $rc)"
  printf '%-16s %-16s %4ss\n' "$name" "$status" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
}

R="$OUT/results.jsonl"
step env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
  $PY -c 'import torch, transformers, timm, peft, sapien, mani_skill, hydra, tensordict, gymnasium, math_verify, m2flow; \
print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, \"timm\", timm.__version__, \"peft\", peft.__version__, \"cuda\", torch.cuda.is_available())'; \
  nproc; free -g | head -2"
step vla_oft 80 $PY bench/gpu.py --results "$R" vla --kind oft
step vla_oft_ckpt 80 $PY bench/gpu.py --results "$R" vla --kind oft --batches 8 --train-batches 16 32 \
  --gradient-checkpointing
step pi0 90 $PY bench/gpu.py --results "$R" pi0 --batches 64 --train-batches 8 32
step context_switch 35 $PY bench/context_switch.py --sizes 1e8 5e8 --repeats 3
step physx 15 $PY bench/gpu.py --results "$R" physx
step render 40 $PY bench/gpu.py --results "$R" render --num-envs 16 --steps 60
step reasoning 110 bash -c "$PY bench/gpu.py --results $R qwen --out /tmp/qwen05 && \
  $PY -c 'from m2flow.cli.train import main as train; raise SystemExit(train())' --config-name reasoning_arith_grpo_tiny \
  model.path=/tmp/qwen05 model.dtype=bfloat16 cluster=reasoning_inprocess_gpu algorithm.reward=math_verify \
  warm_start.steps=60 warm_start.learning_rate=3e-4 algorithm.learning_rate=1e-6 runner.num_steps=4 \
  runner.max_minutes=null runner.eval_interval=2 runner.checkpoint_interval=0 runner.progress_bar=false \
  runner.log_dir=/tmp/runs data.test_size=64"
step pytest 90 $PY -m pytest -m gpu -p no:cacheprovider -q --timeout 60 -o addopts="" \
  --ignore=tests/plugin tests
step pipeline 120 $PY bench/pipeline.py --case vla128 --num-envs 16 --rounds 1 --steps 20 \
  --cluster gpu_inprocess --set env.render_backend=gpu env.sim_backend=cpu
# the planner on the same case, from its own GPU profile (inference timed at each stage's batch
# size, 16/8/4): the S it picks against the S=1/2/4 the pipeline step above measured
step plan_gpu 180 $PY -c 'from m2flow.cli.plan import main; raise SystemExit(main())' \
  --config-name maniskill_pickcube_ppo_openvla_tiny --no-calibrate --no-overlap --top 12 \
  --output /tmp/plan_vla128/plan.yaml cluster=gpu_inprocess env.num_envs=16 \
  env.render_backend=gpu env.sim_backend=cpu policy.image_size=128 \
  policy.hidden_size=256 policy.num_layers=4 policy.intermediate_size=512
ray_step() {  # a step that needs Ray: skipped, saying so, where the Ray part was not unpacked
  if [ -d /tmp/site/ray ]; then step "$@"; else
    case " $STEPS " in *" $1 "*) printf '%-16s %-16s %4ss\n' "$1" "skipped (no Ray)" 0 \
      | tee -a "$OUT/summary.txt" ;; esac
  fi
}
TRAIN="$PY -c 'from m2flow.cli.train import main as train; raise SystemExit(train())'"
# Ray actors on the GPU: env (CPU physics) and rollout + learner on GPU 0, taking turns, the
# idle one's state in pinned host memory (context switch), CUDA tensors crossing processes
ray_step ray_embodied 150 bash -c "$TRAIN --config-name maniskill_pushcube_ppo_mlp \
  cluster=gpu_collocated env.num_envs=64 runner.num_iterations=4 \
  runner.eval_interval=2 runner.eval_episodes=64 runner.checkpoint_interval=2 \
  runner.progress_bar=false runner.log_dir=/tmp/runs"
ray_step ray_reasoning 150 bash -c "[ -d /tmp/qwen05 ] || $PY bench/gpu.py --results $R qwen --out /tmp/qwen05; \
  $TRAIN --config-name reasoning_arith_grpo_tiny model.path=/tmp/qwen05 model.dtype=bfloat16 \
  cluster=reasoning_collocated_gpu algorithm.reward=math_verify warm_start.steps=30 \
  warm_start.learning_rate=3e-4 algorithm.learning_rate=1e-6 runner.num_steps=3 \
  runner.max_minutes=null runner.eval_interval=3 runner.checkpoint_interval=0 \
  runner.progress_bar=false runner.log_dir=/tmp/runs data.test_size=64"
step vla_openvla 60 $PY bench/gpu.py --results "$R" vla --kind openvla --batches 8 32 64 --train-batches 8
mjlab_step() {  # a step that needs the mjlab part: skipped, saying so, where it is not unpacked
  if [ -d /tmp/site/mjlab ]; then step "$@"; else
    case " $STEPS " in *" $1 "*) printf '%-16s %-16s %4ss\n' "$1" "skipped (no mjlab)" 0 \
      | tee -a "$OUT/summary.txt" ;; esac
  fi
}
# MuJoCo Warp on the GPU: the adapter against mjlab's own env on CUDA (the first build compiles
# Warp's kernels for the GPU, cached for the steps after it), then Lift-Cube-Yam state PPO with
# 4096 envs, m2flow against mjlab's train.py, then pipelining with GPU simulation and a GPU VLA
mjlab_step mjlab_env 240 $PY -m pytest -m gpu -p no:cacheprovider -q -o addopts="" \
  tests/envs/test_mjlab.py
mjlab_step mjlab_lift 420 $PY bench/mjlab_liftcube.py --results "$R" --out /tmp/mjlab_lift \
  --num-envs 4096 --iterations 100
mjlab_step mjlab_pipeline 300 bash -c "$PY bench/pipeline.py --case mjlab_vla \
  --cluster mjlab_gpu_inprocess --num-envs 256 --rounds 1 --steps 20 && \
  $PY bench/pipeline.py --case mjlab_vla1b --cluster mjlab_gpu_inprocess --num-envs 64 --rounds 1 --steps 12"
cat "$OUT/summary.txt" 2>/dev/null || echo "gpu_check: no step ran (STEPS: $STEPS)"
# a device call brings back at most 8 files: the step logs travel as one archive
(cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar -czf logs.tgz ./*.log && rm -f ./*.log)
