#!/usr/bin/env bash
# Issue 30's async scheduling on one GPU lease: the CUDA tests, then the engine before and after. Results to $OUT.
# Needs ab_baseline/ (the commit before: `git archive <commit> minillm kernels benchmarks ':!minillm/models' | tar -x
# -C ab_baseline`, then this tree's engine_throughput{,_ab}.py copied into ab_baseline/benchmarks/), carried to the
# device. Each step fits the device's 10-minute limit per command if run on its own:
#   MINILLM_COMMIT=<short hash> bash benchmarks/async_session.sh {tests|throughput|steps|transformers}
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
[ -e minillm/kernels ] || ln -s "$PWD/kernels" minillm/kernels
case "${1:-tests}" in
tests)
  python3 -m pytest tests/engine/test_cuda_graphs.py tests/engine/test_async_scheduling.py \
      tests/sampler/test_speculative.py tests/decoding/test_generate.py tests/lora/test_lora.py \
      tests/kernels/test_fused_kernels.py tests/engine/test_engine.py -q -p no:cacheprovider 2>&1 | tail -5 ;;
throughput)  # the commit before, then this tree with async scheduling off and on alternately; each after a full warm-up
  [ -e ab_baseline/minillm/kernels ] || ln -s "$PWD/ab_baseline/kernels" ab_baseline/minillm/kernels
  mkdir -p ab_baseline/results/engine_throughput_ab  # the baseline's own common.py makes results/ only
  (cd ab_baseline && PYTHONPATH="$PWD" python3 benchmarks/engine_throughput_ab.py --full-warmup \
      --modes default default default --name before) && cp ab_baseline/results/engine_throughput_ab/before.json \
      "$OUT/engine_throughput_ab_before.json"
  python3 benchmarks/engine_throughput_ab.py --full-warmup --modes sync async sync async sync async \
      --name after && cp results/engine_throughput_ab/after.json "$OUT/engine_throughput_ab_after.json" ;;
steps)  # batch 1 and 64, both shapes: replay, graph step, engine synchronous and async
  python3 benchmarks/roofline.py --hf none --name cuda_async 2>&1 | tail -12
  cp results/roofline/cuda_async.json "$OUT/roofline_cuda_async.json" ;;
transformers)  # against transformers' static batches of 64 in the same run
  python3 benchmarks/engine_throughput.py --hf-single 2 2>&1 | tail -8
  cp results/engine_throughput/cuda.json "$OUT/engine_throughput_cuda.json" ;;
esac
