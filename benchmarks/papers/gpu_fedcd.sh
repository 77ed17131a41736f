#!/usr/bin/env bash
# The FedCD benchmark (benchmarks/papers/fedcd_fmnist.py) on a GPU machine whose Python has torch but neither
# pydantic nor Ray. Send along .gpu/whl (pydantic and pydantic-core wheels for its Python) and .gpu/fmnist
# (Debian's Fashion-MNIST .gz files); results go to $OUT (default results/gpu): fedcd_fmnist.md / .json and runs.tgz.
#   bash benchmarks/papers/gpu_fedcd.sh [fedcd_fmnist.py options]
set -euo pipefail
OUT=${OUT:-results/gpu}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fmnist/*.gz /usr/share/datasets/fashion-mnist/
nvidia-smi -L
python3 -c 'import torch, pydantic; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
# Runs live outside $OUT: only a few files come back from a device call, so the runs' small files
# (summary, history, clients, config) come back as one archive, written even when the time limit stops
# the benchmark. The default runs folder is the repository's, so the runs already recorded there are
# skipped; back here: tar xzf runs.tgz -C benchmarks/results && fedcd_fmnist.py --report-only
RUNS=${RUNS:-$PWD/benchmarks/results/fedcd_fmnist_runs}
timeout "${LIMIT_S:-520}" python3 benchmarks/papers/fedcd_fmnist.py --device cuda --jobs "${JOBS:-15}" --out "$OUT" \
  --runs-dir "$RUNS" "$@" || echo "benchmark stopped (exit $?): the finished runs are in the archive"
tar czf "$OUT/runs.tgz" --exclude='*.pt' --exclude='*.png' -C "$(dirname "$RUNS")" "$(basename "$RUNS")"
ls -la "$OUT"
