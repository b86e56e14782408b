"""Do the multi-process engines give the one-process engine's tokens on real GPUs? (chapter 08, issue 31)

The Llama-3.2-1B shape with random bf16 weights, four prompts of 64 random tokens, 32 greedy tokens each, from:
the one-process `LLM`; the disaggregated pair (`minillm.parallel.disagg`, prefill on GPU 0, decode on GPU 1, the KV over
NCCL); and the 2-stage pipeline (`minillm.parallel.pipeline.run_pipeline`, one stage a GPU, NCCL) with 1 and 2
micro-batches. Tensor parallelism's check is in `tensor_parallel.py` (its `same tokens` column).

For each: how many of the 4 x 32 tokens equal the one-process engine's, and the first position where a prompt's
tokens differ (bf16 with random weights has near-ties, where a different order of additions may pick another token;
a difference then changes everything after it, so the first position is the telling number).

    python benchmarks/parallel_parity.py      # needs 2 GPUs; writes results/parallel_parity/cuda.json
"""

from __future__ import annotations

import sys
import tempfile

import torch
from common import write_results
from roofline import SHAPES

import minillm
from minillm.checkpoints import save
from minillm.config import ModelConfig
from minillm.decoding.llm import LLM
from minillm.parallel.disagg import DisaggregatedEngine
from minillm.parallel.pipeline import run_pipeline
from minillm.sampler.sampling import SamplingParams

TOKENS = 32


def compare(name: str, got: list[list[int]], expected: list[list[int]]) -> dict:
    """Equal tokens out of all, and each prompt's first differing position (None: all equal)."""
    first = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    row = {"engine": name, "same_tokens": same, "of": sum(len(e) for e in expected), "first_difference": first}
    print(row, flush=True)
    return row


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs")
        return 1
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                                  "rms_norm_eps": 1e-5, **SHAPES["llama-1B"]})
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = minillm.Transformer(config).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, config.vocab_size, (64,), generator=g).tolist() for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model).generate(prompts, greedy, use_tqdm=False)]
    rows = []
    pair = DisaggregatedEngine(model)
    try:
        rows.append(compare("disaggregated (NCCL)", [o.token_ids for o in pair.generate(prompts, greedy)], expected))
    finally:
        pair.shutdown()
    with tempfile.TemporaryDirectory() as folder:
        save(model, folder)
        for m in (1, 2):
            out = run_pipeline(folder, prompts, TOKENS, stages=2, microbatches=m)
            rows.append(compare(f"pipeline, 2 stages, {m} micro-batch(es) (NCCL)", out.token_ids, expected))
    path = write_results("parallel_parity/cuda", {
        "benchmark": "greedy tokens of the multi-process engines against the one-process engine",
        "settings": {"model": "llama-1B shape, random bf16", "prompts": 4, "prompt_tokens": 64, "tokens": TOKENS,
                     "gpus": [torch.cuda.get_device_name(i) for i in range(2)]},
        "rows": rows})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
