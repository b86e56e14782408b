#!/usr/bin/env bash
# Issue 53's GPU checks in one lease: the paged prefill kernel's and the one-forward mixed step's CUDA tests, the
# engine's CUDA tests, then benchmarks/step_shapes.py (the graphs, packed and split paths). Results to $OUT.
# Give it a lease of its own (about 5 minutes: the tests first, with their output only at the end).
#   bash benchmarks/step_shapes_session.sh [NAME]
set -uo pipefail
export PYTHONUNBUFFERED=1
name=${1:-cuda}
[ -e minillm/kernels ] || ln -s "$PWD/kernels" minillm/kernels  # no install needed
PYTHONPATH="$PWD" python3 -m pytest tests/kernels/test_paged_prefill.py tests/engine/test_paged_kv_cache.py tests/engine/test_mixed_graphs.py \
    tests/engine/test_cuda_graphs.py tests/engine/test_async_scheduling.py tests/engine/test_engine.py \
    -q -p no:cacheprovider 2>&1 | tail -6
PYTHONPATH="$PWD" python3 benchmarks/step_shapes.py --paths ${PATHS_:-graphs packed split} --name "$name" 2>&1 | tail -14
cp "results/step_shapes/$name.json" "$OUT/" 2>/dev/null || echo "no results file"
