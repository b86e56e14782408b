#!/usr/bin/env bash
# Issue 30's host work per row, on one GPU lease: the CUDA tests, then offline throughput of three trees in one
# lease, alternated (the issue's baseline c2e1d62, the tree before this change, this tree), then this tree against
# transformers. Results to $OUT. Each step fits the device's 10-minute limit per command when run on its own:
#   bash benchmarks/host_session.sh {tests|ab ROUND|transformers}     (TREES="ab_x ." to A/B other trees)
# Needs ab_c2e1d62/ and ab_f111635/ carried to the device, each made with
#   git archive <commit> minillm kernels benchmarks ':!minillm/models' | tar -x -C ab_<commit>
# and this tree's engine_throughput{,_ab}.py copied into its benchmarks/ (c2e1d62 named minillm.arithmetic
# minillm.metrics: its copy gets a one-line minillm/arithmetic.py importing everything from minillm.metrics).
set -uo pipefail
export PYTHONUNBUFFERED=1
trees=${TREES:-ab_c2e1d62 ab_f111635 .}
for tree in $trees; do
  [ -e "$tree/minillm/kernels" ] || ln -s "$(cd "$tree" && pwd)/kernels" "$tree/minillm/kernels"  # no install needed
done
case "${1:-tests}" in
tests)
  PYTHONPATH="$PWD" python3 -m pytest tests/engine/test_cuda_graphs.py tests/engine/test_async_scheduling.py \
      tests/engine/test_engine.py tests/engine/test_paged_kv_cache.py tests/decoding/test_generate.py \
      tests/kernels/test_kernels.py -q -p no:cacheprovider 2>&1 | tail -5 ;;
ab)  # one round: each tree in a fresh process, after a full untimed run of the workload
  round=${2:-1}
  for tree in $trees; do
    label=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && label=this_tree
    mkdir -p "$tree/results/engine_throughput_ab"  # an older tree's own common.py makes results/ only
    (cd "$tree" && PYTHONPATH="$PWD" python3 benchmarks/engine_throughput_ab.py --full-warmup --modes default \
        --name "${label}_r${round}" 2>&1 | grep -E "minillm|steps with") \
      && cp "$tree/results/engine_throughput_ab/${label}_r${round}.json" "$OUT/engine_throughput_ab_${label}_r${round}.json"
  done ;;
transformers)  # against transformers' static batches of 64 in the same run
  PYTHONPATH="$PWD" python3 benchmarks/engine_throughput.py --hf-single 2 2>&1 | tail -8
  cp results/engine_throughput/cuda.json "$OUT/engine_throughput_cuda.json" ;;
esac
