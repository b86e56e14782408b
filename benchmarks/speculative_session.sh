#!/usr/bin/env bash
# Issue 53 part 3's GPU checks in one lease: the CUDA tests of the verify graphs, the draft model's fast path and the
# engine's graphs, then benchmarks/speculative_controlled.py, its results written straight to $OUT as it goes.
#   bash benchmarks/speculative_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
[ -e minillm/kernels ] || ln -s "$PWD/kernels" minillm/kernels  # no install needed
export MINILLM_COMMIT=${MINILLM_COMMIT:-unknown}
timeout 200 env PYTHONPATH="$PWD" python3 -m pytest tests/sampler/test_speculative.py tests/engine/test_mixed_graphs.py \
    tests/engine/test_cuda_graphs.py -q -p no:cacheprovider -x 2>&1 | tail -15
cd benchmarks && PYTHONPATH="$PWD/.." python3 speculative_controlled.py --name "$OUT/cuda" "$@" 2>&1 | tail -60
