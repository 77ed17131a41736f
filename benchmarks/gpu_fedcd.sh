#!/usr/bin/env bash
# The FedCD benchmark (benchmarks/fedcd_fmnist.py) on a GPU machine whose Python has torch but neither
# pydantic nor Ray. Send along .gpu/whl (pydantic and pydantic-core wheels for its Python) and .gpu/fmnist
# (Debian's Fashion-MNIST .gz files); results go to $OUT (default results/gpu).
#   bash benchmarks/gpu_fedcd.sh [fedcd_fmnist.py options]
set -euo pipefail
OUT=${OUT:-results/gpu}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fmnist/*.gz /usr/share/datasets/fashion-mnist/
nvidia-smi -L
python3 -c 'import torch, pydantic; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
timeout "${LIMIT_S:-520}" python3 benchmarks/fedcd_fmnist.py --device cuda --jobs "${JOBS:-15}" --out "$OUT" \
  --runs-dir "$OUT/runs" "$@" || echo "benchmark stopped (exit $?): finished runs are in $OUT/runs"
