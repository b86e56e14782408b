"""The batch-1 decode step with its linear layers on cuBLAS or on minillm's matrix-vector kernel (issue 30).

At batch 1 each linear layer is one row times a weight matrix (`minillm.kernels.matvec`). A kernel's speed
alone, timed over one matrix again and again, says little here: a 2048 x 2048 bf16 matrix (8 MB) stays in
the GPU's L2 cache between calls, where the step reads it from memory once. So everything is measured
inside the engine's own graph step (`DecodeGraphs`, as `roofline.py` captures it), on Llama-3.2-1B's and
Llama-3-8B's shapes (random bf16 weights, a 512-token context):

- `cublas`: the graph captured with MINILLM_MATVEC=0 (the layers as `nn.Linear`, cuBLAS);
- `matvec TILES_BY_K`: the kernel with the tiles `minillm.kernels.matvec` chooses by K;
- `matvec (BN, W, V)`: the kernel with BN outputs a program, W warps, V weights a thread per row and step,
  for every layer; `matvec K=k: (BN, W, V)`: that tile for the layers of k inputs only, the rest at the
  default (a coordinate search over the shape's two K: q/k/v, o and gate/up read the model's width,
  down its MLP's).

`--sweep pdl` compares, instead, minillm's kernels launched with programmatic dependent launch (kernels/pdl.py)
and without. (The block's RMSNorms computed inside the next projection's matvec kernel were measured slower,
results/matvec/archive/matvec_cuda_norm.json and results/matvec/cuda_pdl.json, with the code of commit c81decc,
and removed.)

For each: the bare replay's time per step (CUDA events, the median of `--rounds` rounds of `--steps`
replays, the variants alternated round by round), and one profiled step: GPU time of the matrix products
(cuBLAS's GEMMs and split-K reductions, or the kernel) and the kernels per step. The roofline is
`roofline.py`'s: weight and KV bytes over the measured copy bandwidth.

    python benchmarks/matvec.py                  # a CUDA GPU: writes results/matvec/cuda.json
    python benchmarks/matvec.py --sweep pdl      # results/matvec/cuda_pdl.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import minillm.kernels  # registers minillm.kernels.matvec, whose tile `capture` sets
import torch
from common import write_results
from decode_attention import copy_bandwidth
from roofline import SHAPES, prefilled_cache, profile_steps

from minillm import arithmetic
from minillm.engine.cuda_graphs import DecodeGraphs

DEFAULT = (4, 2, 8)  # (outputs, warps, vec) for every K: the first sweep's best at the 8B shape
CANDIDATES = [(8, 4, 8), (4, 2, 16), (8, 2, 8), (4, 4, 8), (2, 2, 8)]
K_CLASSES = {"llama-1B": [2048, 8192], "llama-8B": [4096, 14336]}  # the layers' K: q/k/v, o, gate/up; down


def variants(shape: str, sweep: str = "tiles") -> dict[str, dict]:
    """The graphs to capture, by name: {"tiles": TILES_BY_K or None for cuBLAS, "pdl": programmatic dependent launch
    on or off (absent: the kernels' own choice)}. "tiles": cuBLAS, the default tile everywhere, then each K class of
    the shape with each candidate tile (the others at the default). "pdl": cuBLAS, the kernels without and with PDL
    (kernels/pdl.py)."""
    table = list(sys.modules["minillm.kernels.matvec"].TILES_BY_K)
    if sweep == "pdl":
        return {"cublas": {"tiles": None, "pdl": False}, "pdl off": {"tiles": table, "pdl": False},
                "pdl on": {"tiles": table, "pdl": True}}
    out = {"cublas": {"tiles": None}, "matvec TILES_BY_K": {"tiles": table},
           f"matvec {DEFAULT}": {"tiles": [(None, DEFAULT)]}}
    for k in K_CLASSES[shape]:
        for tile in CANDIDATES:
            out[f"matvec K={k}: {tile}"] = {"tiles": [(k - 1, DEFAULT), (k, tile), (None, DEFAULT)]}
    return out


def capture(model, cache, variant: dict, max_seq_len: int) -> DecodeGraphs:  # noqa: ANN001
    """Batch-1 decode graphs of a `variants` entry: cuBLAS or the matvec kernel with its TILES_BY_K, PDL on or off;
    fixed at capture."""
    module = sys.modules["minillm.kernels.matvec"]
    saved = module.TILES_BY_K
    settings = {"MINILLM_MATVEC": "0" if variant["tiles"] is None else "1"}
    if "pdl" in variant:
        settings["MINILLM_PDL"] = "1" if variant["pdl"] else "0"
    os.environ.update(settings)
    module.TILES_BY_K = variant["tiles"] or saved
    try:
        return DecodeGraphs(model, cache, max_batch=1, max_seq_len=max_seq_len)
    finally:
        module.TILES_BY_K = saved
        for name in settings:
            os.environ.pop(name)


def random_model(shape: str, max_position_embeddings: int = 4096):  # noqa: ANN201 - a minillm Transformer
    """minillm's conversion of a transformers Llama of `shape` (SHAPES), random bf16 weights (seed 0), on the GPU."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=max_position_embeddings)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    return minillm.from_transformers(hf)


def alternated_replays(graphs: dict, rounds: int, steps: int) -> dict:
    """Seconds per replay of each batch-1 graph, `rounds` rounds of `steps` replays, the graphs taking turns."""
    times: dict = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(replay_seconds(g, steps))
    return times


def replay_seconds(graphs: DecodeGraphs, steps: int) -> float:
    graph = graphs.graphs[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sweep", choices=["tiles", "pdl"], default="tiles")
    parser.add_argument("--name", default=None, help="the results file: results/matvec/<name>.json "
                        "(default cuda, or cuda_pdl with --sweep pdl)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/matvec.py needs a CUDA GPU.")
    args.name = args.name or {"tiles": "cuda"}.get(args.sweep, f"cuda_{args.sweep}")
    bandwidth, _ = copy_bandwidth()
    rows = []
    for shape in args.shapes:
        model = random_model(shape)
        bytes_read = (arithmetic.weight_bytes_read(model.config, 1)
                      + arithmetic.kv_cache_bytes(model.config, args.context, 1))
        roofline = bytes_read / bandwidth
        tables = variants(shape, args.sweep)
        graphs, logits = {}, {}
        for name, tiles in tables.items():  # each on its own copy of the same prefilled cache (seeded)
            cache, tokens = prefilled_cache(model, 1, args.context, args.steps + 20)
            graphs[name] = capture(model, cache, tiles, args.context + args.steps + 20)
            logits[name] = graphs[name].run([0], tokens).float()  # the same position and token for each
        times = alternated_replays(graphs, args.rounds, args.steps)
        for name, g in graphs.items():
            profile = profile_steps(lambda g=g, t=tokens: g.run([0], t))
            replay = statistics.median(times[name])
            rows.append({"shape": shape, "variant": name, "tiles_by_k": tables[name]["tiles"],
                         "pdl": tables[name].get("pdl"), "roofline_step_s": roofline,
                         "replay_s": replay, "replay_s_rounds": times[name], "replay_fraction": roofline / replay,
                         "matmul_us": profile["by_kind_us"].get("matmul", 0.0),
                         "kernels_per_step": profile["kernels_per_step"], "top_kernels_us": profile["top_kernels_us"],
                         "max_abs_logit_diff_vs_cublas": (logits[name] - logits["cublas"]).abs().max().item(),
                         "same_next_token": bool(logits[name].argmax() == logits["cublas"].argmax())})
            print(f"{shape} {name:28} replay {replay * 1e3:6.3f} ms ({roofline / replay:4.0%} of roofline), "
                  f"matmul {rows[-1]['matmul_us']:6.0f} us, {profile['kernels_per_step']:.0f} kernels", flush=True)
        del graphs, model
        torch.cuda.empty_cache()
    path = write_results(f"matvec/{args.name}", {
        "benchmark": "batch-1 graph replay: cuBLAS against the matvec kernel's tiles"
                     + {"tiles": "", "pdl": ", launched with PDL or not"}[args.sweep],
        "copy_bandwidth_bytes_per_s": bandwidth, "settings": vars(args), "rows": rows})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
