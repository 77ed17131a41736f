#!/usr/bin/env bash
# Does runtime.precision=bf16 change a method's result? FedAvg (quickstart) and DaFKD (dafkd_fmnist) on real
# Fashion-MNIST, float32 against bf16, seeds 0-2, ROUNDS rounds, on a CPU (runtime.vectorize=auto: sequential
# clients). The control, float32_vectorised: float32 with runtime.vectorize=true, whose clients differ from the
# sequential ones by float32 rounding only, to show how far such a difference alone carries a run at alpha = 0.1.
# The table (mean ± std over seeds; the mean of the last 5 rounds) goes to benchmarks/results/precision_fmnist.md,
# with each seed's paired difference from float32. Runs are resumable (a finished run's directory is skipped),
# JOBS at a time, one torch thread each. On a CPU without bfloat16 arithmetic (this project's machines) bf16 is
# emulated, ~1.7x (FedAvg) to 2.3x (DaFKD) slower: this checks the numbers, not the speed; ~24 min with JOBS=2.
#   bash benchmarks/speed/precision_fmnist.sh            # ROUNDS=30 JOBS=2 RUNS=benchmarks/results/precision_fmnist_runs
set -euo pipefail
ROUNDS=${ROUNDS:-30} JOBS=${JOBS:-2} RUNS=${RUNS:-benchmarks/results/precision_fmnist_runs}
FEDRAY=${FEDRAY:-.venv/bin/fedray}
plan() {
  for preset in dafkd_fmnist quickstart; do
    for variant in float32 bf16 float32_vectorised; do
      for seed in 0 1 2; do echo "$preset $variant $seed"; done
    done
  done
}
one() {  # one PRESET VARIANT SEED
  local out="$RUNS/$1_$2_seed$3" vectorize=auto
  [ -f "$out/summary.json" ] && return 0
  [ "${2#*_}" = vectorised ] && vectorize=true
  OMP_NUM_THREADS=1 "$FEDRAY" run "$1" seed="$3" federation.rounds="$ROUNDS" runtime.precision="${2%_*}" \
    runtime.vectorize=$vectorize \
    runtime.num_cpus_per_worker=1 tracking.enabled=false --no-progress --output-dir "$out" > "$out.log" 2>&1 \
    && echo "done $1 $2 seed $3" || { echo "FAILED $1 $2 seed $3: see $out.log"; return 1; }
}
export -f one
export ROUNDS RUNS FEDRAY
mkdir -p "$RUNS"
plan | xargs -P "$JOBS" -L 1 bash -c 'one "$@"' _
"$FEDRAY" report "$RUNS" --by-setting runtime.precision,runtime.vectorize --out benchmarks/results/precision_fmnist.md
# Paired by seed (same partition, same clients each round): each variant's last-5 mean minus float32's.
"${FEDRAY%/fedray}/python" - "$RUNS" "$ROUNDS" >> benchmarks/results/precision_fmnist.md <<'EOF'
import sys
from pathlib import Path

import pyarrow.parquet as pq

runs, rounds = Path(sys.argv[1]), sys.argv[2]


def last5(preset: str, variant: str, seed: int) -> float:
    acc = pq.read_table(runs / f"{preset}_{variant}_seed{seed}" / "history.parquet").column("eval/accuracy")
    vals = [v for v in acc.to_pylist() if v is not None][-5:]
    return 100 * sum(vals) / len(vals)


print(f"\nPaired by seed, {rounds} rounds: each seed's last-5 mean (%), and its difference from float32's.\n")
print("| preset | variant | seed 0 | seed 1 | seed 2 | minus float32, by seed | mean |")
print("| :--- | :--- | ---: | ---: | ---: | :--- | ---: |")
for preset in ("quickstart", "dafkd_fmnist"):
    base = [last5(preset, "float32", s) for s in range(3)]
    for variant in ("float32", "bf16", "float32_vectorised"):
        vals = [last5(preset, variant, s) for s in range(3)]
        diffs = [v - b for v, b in zip(vals, base)]
        first = variant == "float32"
        delta = "" if first else ", ".join(f"{d:+.2f}" for d in diffs)
        mean = "" if first else f"{sum(diffs) / 3:+.2f}"
        print(f"| {preset} | {variant} | {' | '.join(f'{v:.2f}' for v in vals)} | {delta} | {mean} |")
EOF
