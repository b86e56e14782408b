"""How much padding a step's prompt chunks carry in a rectangular batch: the scheduler replayed alone (chapter 05).

engine_throughput.py's workload (256 requests, prompt and output lengths uniform in 100..1024, seeded), its
engine settings (max_num_seqs 256, a token budget of 8,192, chunked prefill, blocks of 16 for every request's
final length) and greedy requests that each run exactly their output length: the schedule then depends on
the lengths only, so the scheduler runs here without a model (a tiny config stands in for the cache) and every
"sampled" token is a placeholder id. For each step with prompt chunks: the chunks' real tokens against the
positions a left-padded batch [P, T] computes, P x the longest chunk, and the attention scores each computes.

    python benchmarks/prefill_padding.py    # writes results/prefill_padding/cpu.json (a few seconds, any machine)
"""

from __future__ import annotations

from common import write_results
from engine_throughput import LLAMA_1B, make_requests

from minillm import arithmetic
from minillm.config import ModelConfig
from minillm.engine.kv_cache import PagedKVCache
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.sampler.sampling import SamplingParams


def main() -> None:
    requests = make_requests(256, 100, 1024, LLAMA_1B["vocab_size"])
    longest = max(len(p) + n for p, n in requests)
    config = ModelConfig(dim=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8, vocab_size=LLAMA_1B["vocab_size"],
                         max_seq_len=4096)
    cache = PagedKVCache(config, 256 * arithmetic.kv_blocks(longest, 16), 16)
    scheduler = Scheduler(cache, 256, 8192)
    for i, (prompt, n) in enumerate(requests):
        scheduler.add(Sequence(str(i), prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    steps = prefill_steps = real = padded = scores_real = scores_padded = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        steps += 1
        chunks = [(seq, n) for seq, n in plan.scheduled if n > 1]
        if chunks:
            prefill_steps += 1
            width = max(n for _, n in chunks)
            keys = max(seq.num_computed_tokens + n for seq, n in chunks)
            real += sum(n for _, n in chunks)
            padded += width * len(chunks)
            scores_real += sum(n * (seq.num_computed_tokens + n) for seq, n in chunks)
            scores_padded += len(chunks) * width * keys
        for seq, n in plan.scheduled:  # what the forward and the sampler would do
            cache.commit([cache.block_tables[seq.seq_id]], [[0] * n])
            seq.num_computed_tokens += n
            if seq.num_uncomputed_tokens == 0:
                seq.output_token_ids.append(1)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    scheduler.finish(seq, "length")
    out = {"steps": steps, "steps_with_prompt_chunks": prefill_steps, "prompt_tokens": real,
           "padded_positions": padded, "padded_per_prompt_token": padded / real,
           "attention_scores_packed": scores_real, "attention_scores_padded": scores_padded,
           "attention_padded_over_packed": scores_padded / scores_real}
    path = write_results("prefill_padding/cpu", {
        "benchmark": "padding of prompt chunks batched rectangularly, engine_throughput.py's workload replayed on "
                     "the scheduler alone (no model)", **out})
    print(f"{steps} steps, {prefill_steps} with prompt chunks: {real:,} prompt tokens computed as {padded:,} padded "
          f"positions ({padded / real:.2f}x); attention scores {scores_padded / scores_real:.2f}x; written to {path}")


if __name__ == "__main__":
    main()
