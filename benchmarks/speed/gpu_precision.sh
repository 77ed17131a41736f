#!/usr/bin/env bash
# The GPU check of runtime.precision=bf16 (issue 13), one device call:
# 1. DaFKD ResNet-11 (no diag/*) at 8 and 32 clients, float32 against bf16, sequential and vectorised with CUDA
#    graphs (machines of one kind differ 1.7x in their sequential rounds, so only rows of one call compare);
# 2. where DaFKD's server round goes (server_phases.py: the server caps the speed-up);
# 3. bf16's padded 32-client graphs against eager steps;
# 4. DaFKD's Ray row with CUDA graphs (8 clients), if time is left.
# The steps share BUDGET seconds (default 560), each cut to what is left, so the call returns with what finished.
# Send along .gpu/whl (../shared/GPU.md); tables printed and written under $OUT.
#   bash benchmarks/speed/gpu_precision.sh
set -uo pipefail
OUT=${OUT:-results/gpu}
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); echo $((l < $1 ? (l > 1 ? l : 1) : $1)); }  # min(limit, seconds left)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
nvidia-smi -L
mkdir -p "$OUT"
echo "=== rows"
timeout $(left 380) python3 benchmarks/speed/gpu.py --out "$OUT/bf16" --rounds 3 --per-round 8 32 --no-ray \
  --workloads dafkd_resnet11_nodiag dafkd_resnet11_nodiag_bf16 --modes graphs sequential > "$OUT/bf16.log" 2>&1 \
  || echo "=== rows stopped (exit $?)"
grep '^{' "$OUT/bf16.log"; cat "$OUT/bf16/gpu.md"
echo "=== server phases"
timeout $(left 90) python3 benchmarks/speed/server_phases.py --out "$OUT/sp" --per-round 8 32 \
  --workloads dafkd_resnet11_nodiag > "$OUT/sp.log" 2>&1 || echo "=== server phases stopped (exit $?)"
cat "$OUT/sp/server_phases.md"
echo "=== graph check"
timeout $(left 150) python3 benchmarks/speed/gpu.py --out "$OUT/gc" --rounds 1 --per-round 8 --no-ray \
  --workloads fedavg_lenet5 --modes graphs --graph-check "padded, bf16" > "$OUT/gc.log" 2>&1 \
  || echo "=== graph check stopped (exit $?)"
tail -n 12 "$OUT/gc/gpu.md"
echo "=== ray row"
timeout $(left 200) python3 benchmarks/speed/gpu.py --out "$OUT/ray" --rounds 3 --per-round 8 --ray-per-round 8 \
  --workloads dafkd_resnet11 --modes graphs > "$OUT/ray.log" 2>&1 || echo "=== ray row stopped (exit $?)"
cat "$OUT/ray/gpu.md"
