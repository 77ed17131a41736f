#!/usr/bin/env bash
# The GPU checks of the vectorised lockstep's padded BatchNorm rounds and phases (issue 13), in priority order, each
# under its own time limit (560 s together: one device call within its 600 s). Send along .gpu/whl (../shared/GPU.md:
# make_bundle.sh); every table is printed (a device call returns few files) and written under $OUT (default results/gpu).
#   bash benchmarks/speed/gpu_lockstep.sh
set -uo pipefail
OUT=${OUT:-results/gpu}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi -L
step() {  # step SECONDS NAME COMMAND...: run it, print its table, go on whatever happened
  local limit=$1 name=$2; shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || echo "=== $name stopped (exit $?)"
  tail -n 25 "$OUT/$name.log"
}
mkdir -p "$OUT"
# 1. 32 DaFKD clients a round, padded (was 11.660 s/round graphed, 25.791 sequential, 4.35 vmap calls a step)
step 180 k32 python3 benchmarks/speed/gpu.py --out "$OUT/k32" --rounds 3 --per-round 32 --no-ray \
  --workloads dafkd_resnet11 --modes graphs sequential
# 2. one local epoch (clients done after 15-116 steps): the round in phases, each with its own graph
step 150 e1 python3 benchmarks/speed/gpu.py --out "$OUT/e1" --rounds 3 --per-round 8 --no-ray \
  --workloads dafkd_resnet11_e1 --modes graphs sequential
# 3. padded rounds' graphs against eager steps on CUDA (FedAvg ResNet-8-BN and DaFKD ResNet-11, 32 clients)
step 160 graph_check python3 benchmarks/speed/gpu.py --out "$OUT/gc" --rounds 1 --per-round 8 --no-ray \
  --workloads fedavg_lenet5 --modes graphs --graph-check padded
# 4. does cuDNN's measured algorithm choice or bfloat16 lift ResNet-11's grouped-convolution ceiling?
step 70 step_ceiling python3 benchmarks/speed/step_ceiling.py --out "$OUT/sc" --models resnet11 --clients 8 32 --reps 20 \
  --variants default cudnn_benchmark bf16
