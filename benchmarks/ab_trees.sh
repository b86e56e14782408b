#!/usr/bin/env bash
# A/B on one GPU lease: the same benchmark in two source trees, alternated, results to $OUT/<label>_<name>.json.
# Run from the repository root on the device machine (no install: each tree goes on PYTHONPATH in turn):
#   bash benchmarks/ab_trees.sh BASELINE_DIR "roofline.py --hf none" roofline/cuda [ROUNDS]
# BASELINE_DIR holds an earlier commit's minillm/, kernels/, benchmarks/ (`git archive <commit> ... | tar -x`).
# The benchmark must write results/<name>.json (benchmarks/common.py's write_results); each run's copy is kept.
# A tree from before results/<benchmark>/ wrote results/<benchmark>_<device>.json (or <benchmark>.json): found too.
set -uo pipefail
baseline=$(cd "$1" && pwd) bench=$2 name=$3 rounds=${4:-1}
export PYTHONUNBUFFERED=1
for tree in "$baseline" "$PWD"; do
  [ -e "$tree/minillm/kernels" ] || ln -s "$tree/kernels" "$tree/minillm/kernels"  # minillm.kernels without an install
done
for round in $(seq 1 "$rounds"); do
  for label in before after; do
    tree=$PWD; [ "$label" = before ] && tree=$baseline
    echo "== $label ($tree), round $round: $bench"
    (cd "$tree" && PYTHONPATH="$tree" python3 benchmarks/$bench) 2>&1 | tail -12
    for src in "$tree/results/$name.json" "$tree/results/${name/\//_}.json" "$tree/results/${name%%/*}.json"; do
      [ -e "$src" ] && break
    done
    cp "$src" "$OUT/${label}_${name/\//_}_r${round}.json"
  done
done
