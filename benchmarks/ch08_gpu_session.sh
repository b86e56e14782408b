#!/usr/bin/env bash
# Chapter 08 on two GPUs, one lease: the NCCL disaggregation test, then the interference / KV-transfer, LoRA, pipeline
# and TP benchmarks. Results land in $OUT. Run as: MINILLM_COMMIT=<hash> bash benchmarks/ch08_gpu_session.sh PART
# PART: nccl (the test) | disagg (interference + transfer) | lora | parallel (PP, 1B shape) | tp (1B shape) | parity.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
[ -e minillm/kernels ] || ln -s "$PWD/kernels" minillm/kernels
# A process still running after DUMP_AFTER seconds prints every thread's stack (spawned workers too): a hang
# then says where it waits.
mkdir -p /tmp/dump && printf 'import faulthandler, os, sys\nif os.environ.get("DUMP_AFTER"):\n    faulthandler.dump_traceback_later(int(os.environ["DUMP_AFTER"]), exit=False, file=sys.stderr)\n' \
    > /tmp/dump/sitecustomize.py
export PYTHONPATH="$PWD:/tmp/dump"
case "${1:-nccl}" in
nccl)
  nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m
  DUMP_AFTER=150 timeout 200 python3 -m pytest tests/parallel/test_disagg.py -k "nccl or cuda" -x -q \
      -p no:cacheprovider 2>&1 | tail -60 | tee "$OUT/nccl_test.log" ;;
disagg)
  (cd benchmarks && DUMP_AFTER=500 timeout 560 python3 disagg_interference.py 2>&1 | tee "$OUT/disagg.log")
  cp results/disagg_interference/cuda*.json "$OUT/" 2>/dev/null ;;
lora)
  (cd benchmarks && DUMP_AFTER=250 timeout 280 python3 lora_throughput.py 2>&1 | tail -20 | tee "$OUT/lora.log")
  cp results/lora_throughput/cuda.json "$OUT/" 2>/dev/null ;;
parallel)
  (cd benchmarks && DUMP_AFTER=330 timeout 360 python3 pipeline_bubble.py --shape llama-1B --batch 64 \
      --microbatches 1 2 4 --tokens 32 --repeats 1 2>&1 | tail -14 | tee "$OUT/pp.log")
  cp results/pipeline_bubble/cuda.json "$OUT/" 2>/dev/null ;;
tp)
  (cd benchmarks && DUMP_AFTER=200 timeout 240 python3 tensor_parallel.py --shape llama-1B --tp 1 2 --batch 8 64 \
      --name 1b_2gpu 2>&1 | tail -14 | tee "$OUT/tp.log")
  cp results/tensor_parallel/cuda_1b_2gpu.json "$OUT/" 2>/dev/null ;;
parity)
  (cd benchmarks && DUMP_AFTER=200 timeout 240 python3 parallel_parity.py 2>&1 | grep -v Warning | tail -8 \
      | tee "$OUT/parity.log")
  cp results/parallel_parity/cuda.json "$OUT/" 2>/dev/null ;;
esac
