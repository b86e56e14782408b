#!/usr/bin/env bash
# Issue 52's GPU checks on one lease: the CUDA tests of the engine, then the tree before a change and this tree
# alternated (odd rounds before first, even rounds after first) on the host's step (engine_host_step, batches
# 1/64/256), the batch-1 decode step and offline throughput. Results to $OUT/<label>_<benchmark>_r<round>.json.
# Each mode fits the device's 10 minutes:
#   BEFORE=ab_<commit> bash benchmarks/hall_session.sh {tests|ab ROUND|probe ROUNDS}
# Needs the before tree carried to the device (BEFORE, default ab_d8b3301, the first round of issue 52):
#   mkdir ab_C && git archive C minillm kernels benchmarks ':!minillm/models' | tar -x -C ab_C
# AFTER (default ., this tree) can name a second archived tree, so that edits made while the rounds run
# do not reach the measured tree.
set -uo pipefail
export PYTHONUNBUFFERED=1
before=${BEFORE:-ab_d8b3301}
after=${AFTER:-.}
for tree in "$before" "$after"; do
  [ -e "$tree/minillm/kernels" ] || ln -s "$(cd "$tree" && pwd)/kernels" "$tree/minillm/kernels"  # no install needed
done
run() {  # run TREE LABEL ROUND BENCHMARK ARGS...: one benchmark in one tree, its results file copied to $OUT
  local tree=$1 label=$2 round=$3 bench=$4; shift 4
  (cd "$tree" && PYTHONPATH="$PWD" python3 "benchmarks/$bench.py" "$@" --name "${label}_r${round}" 2>&1 | tail -4)
  for src in "$tree/results/$bench/${label}_r${round}.json" "$tree/results/${label}_r${round}.json"; do
    [ -e "$src" ] && cp "$src" "$OUT/${label}_${bench}_r${round}.json" && break
  done
}
case "${1:-tests}" in
tests)
  PYTHONPATH="$PWD" python3 -m pytest tests/engine/test_cuda_graphs.py tests/engine/test_step_inputs.py \
      tests/kernels/test_fused_kernels.py tests/engine/test_paged_kv_cache.py tests/engine/test_async_scheduling.py \
      tests/engine/test_engine.py tests/engine/test_compiled_decode.py -q -p no:cacheprovider -x 2>&1 | tail -8 ;;
ab)
  round=${2:-1}
  pairs=("$before before" "$after after")
  [ $((round % 2)) -eq 0 ] && pairs=("$after after" "$before before")
  for pair in "${pairs[@]}"; do
    set -- $pair
    run "$1" "$2" "$round" engine_host_step --device cuda --batches 1 64 256
    run "$1" "$2" "$round" roofline --shapes llama-1B --batches 1 --hf none
    run "$1" "$2" "$round" engine_throughput_ab --modes default
  done ;;
probe)  # ROUNDS alternated runs of benchmarks/hall_probe.py, each tree in a fresh process, to $OUT/probe.jsonl
  for round in $(seq 1 "${2:-3}"); do
    pairs=("$before before" "$after after")
    [ $((round % 2)) -eq 0 ] && pairs=("$after after" "$before before")
    for pair in "${pairs[@]}"; do
      set -- $pair
      python3 benchmarks/hall_probe.py "$1" "$2" 2>&1 | tail -1 | tee -a "$OUT/probe.jsonl"
    done
  done ;;
esac
