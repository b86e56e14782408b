#!/usr/bin/env bash
# One lease of a GPU machine: the CUDA tests, then the GPU benchmarks. Results land in $OUT.
# Run as: MINILLM_COMMIT=<short hash> bash benchmarks/gpu_session.sh (the device copy has no git).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# Without an install, minillm.kernels (package-dir mapping of kernels/) is not on the path: link it.
[ -e minillm/kernels ] || ln -s "$PWD/kernels" minillm/kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 -m pytest tests/model/test_model_parity.py tests/decoding/test_generate.py tests/kernels/test_kernels.py \
    -q -p no:cacheprovider -x 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
python3 benchmarks/decode_batch1.py --device cuda --dtypes bfloat16 --sizes small-12M base-110M llama-1B --repeats 3 \
    2>&1 | tee "$OUT/decode_gpu.log"
python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.log"
cp results/decode_batch1/cuda.json results/attention/cuda.json "$OUT/" 2>/dev/null || true
