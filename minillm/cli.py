"""The `minillm` command line.

    minillm generate [--model NAME|PATH] [--max-tokens N] [--temperature T] [--seed S] [--compile]
                     [--device cpu|cuda] [--quant int8|int4|nf4|fp8|gptq-int4|awq-int4|...] PROMPT
    minillm compile [MODEL] [--quant ...] [--kv-cache-dtype ...] [--threads N...]
    minillm export --gguf PATH [--dtype f32|f16|q8_0|q4_0] [--model NAME|PATH]
    minillm grade PATH... [-j N] [--chapter NN] [--timeout S] [--memory-gb G] [--extra-tests DIR]
                  [--csv FILE] [--json FILE]
    minillm drill [--chapter NN] [--tag T] [--level L] [-n K] [--answers FILE]
                  [--mock [--seed S] [--report FILE]]
    minillm book exercises [--check]

Errors print one line (`minillm: error: ...`) and exit with status 1, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from minillm.shipped import CHAT_MODEL, DEFAULT_MODEL, shipped_models

MODEL_HELP = (f"a shipped model's name, the installed pretrained {CHAT_MODEL}, a local Hugging Face folder or a .gguf "
              f"file (default: {DEFAULT_MODEL})")

# minillm.quant.QUANT_OPTIONS, written out so that `minillm --help` does not import torch
QUANT_CHOICES = ("int8", "int4", "nf4", "fp8", "gptq-int4", "awq-int4", "smoothquant", "llm.int8")
QUANT_HELP = ("quantise the weights first (chapter 06): int8/int4/nf4/fp8 round to nearest; gptq-int4, awq-int4 "
              "and smoothquant calibrate on the shipped training sample (default: none)")
GGUF_DTYPES = ("f32", "f16", "q8_0", "q4_0")  # minillm.train.gguf_export.GGUF_TYPES, lower-cased
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # minillm.quant.kv.KV_CACHE_DTYPES, written out likewise
KV_HELP = ("what the KV cache stores (chapter 06): auto (the model's dtype), or int8 / fp8 with a scale per token "
           "and head, about half the bytes (default: auto)")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse prints the message and exits with status 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give a positive one, like 10.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive (1 or more), got {value}: give how many to keep, like 10.")
    return value


def model_name(args: argparse.Namespace) -> str:
    """--model, or the shipped model when it is not given; a clear error when this install ships none."""
    if args.model:
        return args.model
    if DEFAULT_MODEL not in shipped_models():
        raise FileNotFoundError("no model shipped with this install: pass --model PATH to a Hugging Face folder.")
    return DEFAULT_MODEL


@contextlib.contextmanager
def ctrl_c_exits_at_once() -> Iterator[None]:
    """While the command starts (importing PyTorch, loading weights), Ctrl-C ends the process there and then.

    Python's usual KeyboardInterrupt can land in the middle of a library's import and leave it half
    initialised (numpy then fails with a RecursionError, not the interrupt), and there is nothing to
    clean up yet, so exit with 130 (128 + SIGINT) as a shell tool does, printing no traceback.
    """

    def exit_now(signum: int, frame: object) -> None:
        os.write(sys.stderr.fileno(), b"\n")
        os._exit(130)

    previous = signal.signal(signal.SIGINT, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_generate(args: argparse.Namespace) -> int:
    with ctrl_c_exits_at_once():
        import torch

        from minillm.checkpoints import CheckpointError, load
        from minillm.decoding.generation import generate_stream
        from minillm.sampler.sampling import SamplingParams

        name = model_name(args)
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu.")
        model, tokenizer = load(name, device=args.device)
    if tokenizer is None:
        raise CheckpointError(
            f"{name} has no tokenizer.json, so a text prompt cannot be encoded; "
            "copy the model's tokenizer.json into the folder."
        )
    if args.quant:
        from minillm.quant import quantize_by_name

        quantize_by_name(model, args.quant, tokenizer)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompt = args.prompt
    if args.chat:  # the prompt is a user's message, in the model's own chat template
        from minillm.tokenizer import apply_chat_template

        prompt = apply_chat_template([{"role": "user", "content": args.prompt}], tokenizer)
    prompt_ids = tokenizer.encode(prompt)  # as the server encodes a chat: the template renders with bos_token=""
    chunks = []
    for chunk in generate_stream(model, prompt_ids, params, tokenizer, kv_cache_dtype=args.kv_cache_dtype,
                                 compile_decode="background" if args.compile else False):
        chunks.append(chunk)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    ttft = chunks[0].time_s
    decode_s = chunks[-1].time_s - ttft
    rate = f"{(len(chunks) - 1) / decode_s:.1f}" if len(chunks) > 1 and decode_s > 0 else "n/a"
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(
        f"[prompt {len(prompt_ids)} tokens | generated {len(chunks)} tokens ({chunks[-1].finish_reason}) | "
        f"TTFT {ttft * 1e3:.1f} ms | decode {rate} tok/s]",
        file=sys.stderr,
    )
    if args.compile:
        from minillm.engine.compiled_step import BackgroundCompile, CompiledStep

        if BackgroundCompile.started:
            print("[the compiled decode step was not in the cache: it is compiling in the background for the next "
                  "runs (tens of seconds; `minillm compile` does it ahead), and this run decoded eagerly]",
                  file=sys.stderr)
        elif CompiledStep.loads:
            print("[decoded with the compiled step, loaded from the cache]", file=sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Fill the cache of compiled decode steps ahead of time (chapter 02): what `generate --compile` then loads."""
    with ctrl_c_exits_at_once():
        import torch

        from minillm.checkpoints import load
        from minillm.engine import compile_cache
        from minillm.engine.compile_ahead import compile_ahead

        root = compile_cache.cache_root()
        if root is None:
            raise ValueError(f"the cache of compiled steps is off ({compile_cache.CACHE_ENV}=off): "
                             f"unset {compile_cache.CACHE_ENV} or point it at a folder.")
        model, tokenizer = load(model_name(args))
    if args.quant:
        from minillm.quant import quantize_by_name

        quantize_by_name(model, args.quant, tokenizer)
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        for label, step in compile_ahead(model, args.kv_cache_dtype).items():
            how = "found in the cache, loaded" if step.from_cache else "compiled"
            print(f"{label}, {threads} thread(s): {how} in {step.seconds:.1f} s", flush=True)
    print(f"cache: {root}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write the model as a GGUF file llama.cpp runs (chapter 06)."""
    with ctrl_c_exits_at_once():
        from minillm.checkpoints import CheckpointError, load
        from minillm.train.gguf_export import write_gguf

        name = model_name(args)
        model, tokenizer = load(name)
    if tokenizer is None:
        raise CheckpointError(f"{name} has no tokenizer.json, and a GGUF file carries its tokenizer; copy the "
                              "model's tokenizer.json into the folder.")
    try:
        import gguf  # noqa: F401 - the writer comes from llama.cpp's own Python package
    except ImportError:
        raise ValueError("writing GGUF needs the gguf package: pip install gguf") from None
    info = write_gguf(model, tokenizer, args.gguf, args.dtype)
    print(f"wrote {args.gguf}: {info['file_bytes'] / 2**20:.1f} MiB, {info['quantised_tensors']} block linears in "
          f"{args.dtype.upper()}, norms and embedding in F32")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Score a model on the book's tasks; with --baseline, fail (exit 1) on a quality regression (chapter 09)."""
    with ctrl_c_exits_at_once():
        import json

        from minillm.checkpoints import CheckpointError, load
        from minillm.decoding.llm import LLM
        from minillm.eval import agreement, compare, exact_match, format_table, load_task, multiple_choice, perplexity
        from minillm.quant.calibration import validation_ids

        name = model_name(args)
        model, tokenizer = load(name)
    if tokenizer is None:
        raise CheckpointError(f"{name} has no tokenizer.json, and the tasks are text: copy it into the folder.")
    if args.group_size is not None and args.quant != "int4":
        raise ValueError("--group-size sets int4's groups: use it with --quant int4.")
    if args.quant == "int4" and args.group_size is not None:  # e.g. "channel": int4 without groups
        from minillm.quant import quantize

        size = args.group_size if args.group_size == "channel" else int(args.group_size)
        quantize(model, "rtn", bits=4, group_size=size)
    elif args.quant:
        from minillm.quant import quantize_by_name

        quantize_by_name(model, args.quant, tokenizer)
    results: dict = {"model": name, "settings": {"quant": args.quant, "group_size": args.group_size,
                                                 "kv_cache_dtype": args.kv_cache_dtype,
                                                 "limit": args.limit, "reference": args.reference},
                     "results": {}}
    val_ids = None
    for task_name in args.tasks:
        if task_name in ("perplexity", "agreement"):
            val_ids = validation_ids(tokenizer) if val_ids is None else val_ids
            windows = args.limit or 64
            if task_name == "perplexity":
                results["results"]["perplexity"] = {"perplexity": perplexity(model, val_ids, max_windows=windows)}
            else:
                if not args.reference:
                    raise ValueError("the agreement task compares with a reference model: pass --reference MODEL.")
                reference, _ = load(args.reference)
                results["results"]["agreement"] = agreement(model, reference, val_ids, max_windows=windows)
            continue
        task = load_task(task_name)
        if args.limit:
            task.docs = task.docs[: args.limit]
        if task.kind == "multiple_choice":
            results["results"][task.name] = multiple_choice(model, tokenizer, task)
        else:
            llm = LLM(model, tokenizer, kv_cache_dtype=args.kv_cache_dtype)
            results["results"][task.name] = exact_match(llm, task)
        print(f"{task.name}: {results['results'][task.name]}", file=sys.stderr)
    for task_name, metrics in results["results"].items():
        print(task_name, " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    if not args.baseline:
        return 0
    rows = compare(results, json.loads(Path(args.baseline).read_text()))
    print(format_table(rows))
    failed = [r for r in rows if r.failed]
    if failed:
        print(f"FAILED: {len(failed)} metric(s) moved past their tolerance against {args.baseline}.")
        return 1
    print(f"passed: {len(rows)} metric(s) within their tolerances against {args.baseline}.")
    return 0


def cmd_book_exercises(args: argparse.Namespace) -> int:
    from minillm.book import load_book
    from minillm.book.grading.exercises import exercise_text, write_exercises

    if not args.check:
        for path in write_exercises():
            print(f"wrote {path.relative_to(load_book().root)}")
        return 0
    book, stale = load_book(), []
    for chapter in book.written():
        exercise = book.root / chapter.exercise
        expected = exercise_text(book.root / chapter.solution, chapter.solution)
        if not exercise.is_file() or exercise.read_text(encoding="utf-8") != expected:
            stale.append(chapter.exercise)
    if stale:
        print(f"out of date with their solutions: {', '.join(stale)}; run `minillm book exercises`.", file=sys.stderr)
        return 1
    print(f"{len(book.written())} exercise notebooks match their solutions.")
    return 0


def parse_lora_modules(items: list[str] | None) -> dict[str, str] | None:
    """--lora-modules NAME=PATH ... as {name: path} (a ValueError for an item without both)."""
    if not items:
        return None
    modules = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules takes NAME=PATH items (e.g. pirate=adapters/pirate), got {item!r}.")
        modules[name] = path
    return modules


def cmd_serve(args: argparse.Namespace) -> int:
    name = model_name(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    api_key = args.api_key if args.api_key is not None else os.environ.get("MINILLM_API_KEY")
    with ctrl_c_exits_at_once():  # uvicorn handles SIGINT and SIGTERM itself while it serves (a graceful drain)
        from minillm.entrypoints.server import serve

        serve(name, args.host, args.port, args.max_queue, api_key=api_key, served_model_name=args.served_model_name,
              metrics_require_api_key=args.metrics_require_api_key, shutdown_timeout=args.shutdown_timeout,
              max_body_bytes=args.max_body_bytes, timeout_keep_alive=args.timeout_keep_alive,
              limit_concurrency=args.limit_concurrency or None, device=args.device, dtype=args.dtype,
              quant=args.quant, speculative_model=args.speculative_model,
              num_speculative_tokens=args.num_speculative_tokens, enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype, num_blocks=args.num_blocks, block_size=args.block_size,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, disaggregate=args.disaggregate,
              lora_modules=lora_modules, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm", description="minillm: a small, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    gen = sub.add_parser("generate", help="stream a completion of PROMPT", description="Stream a completion of PROMPT.")
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    gen.add_argument("--model", help=MODEL_HELP)
    gen.add_argument("--chat", action="store_true",
                     help=f"PROMPT is a user's message: put it in the model's chat template and answer it (try "
                          f"--model {CHAT_MODEL})")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    gen.add_argument("--quant", choices=QUANT_CHOICES, default=None, help=QUANT_HELP)
    gen.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    gen.add_argument("--compile", action="store_true",
                     help="CPU: decode with the step compiled ahead of time (torch.export and AOTInductor), loaded "
                          "from the cache of compiled steps in milliseconds; where the cache lacks it, it compiles "
                          "in the background for later runs (tens of seconds; `minillm compile` does it ahead) "
                          "while this run decodes eagerly. Faster decoding: results/cpu_decode/cpu.json")
    gen.set_defaults(func=cmd_generate, exit_at_once=True)

    comp = sub.add_parser(
        "compile", help="compile the CPU's decode steps ahead of time, for generate --compile",
        description="Compile the decode steps of MODEL (batch 1 and larger batches) at each thread count and keep "
                    "them in the cache of compiled steps ($MINILLM_COMPILE_CACHE, else ~/.cache/minillm/compiled), "
                    "so that `generate --compile` and the engine load them in milliseconds instead of compiling "
                    "for tens of seconds. Steps already there are checked and loaded, not compiled again.")
    comp.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    comp.add_argument("--quant", choices=QUANT_CHOICES, default=None, help=QUANT_HELP)
    comp.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    comp.add_argument("--threads", type=positive_int, nargs="+", default=None,
                      help="the thread counts to compile for (a step is built for one; default: PyTorch's)")
    comp.set_defaults(func=cmd_compile, exit_at_once=True)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description="Serve a model over an OpenAI-compatible HTTP API (chapter 05): "
                                     "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.")
    srv.add_argument("--model", help=MODEL_HELP)
    srv.add_argument("--served-model-name", default=None,
                     help="the name clients ask for and /v1/models lists (default: the model's folder name)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                     "another address without --api-key prints a warning)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every /v1/ route (default: $MINILLM_API_KEY, else "
                          "none), and on /docs, /redoc and /openapi.json; /health stays open")
    srv.add_argument("--metrics-require-api-key", action="store_true", help="/metrics asks for the API key too")
    srv.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    srv.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                     help="the weights' and activations' dtype; auto: fp32 on a CPU, the checkpoint's on a GPU "
                          "(chapter 00)")
    srv.add_argument("--quant", choices=QUANT_CHOICES, default=None, help=QUANT_HELP)
    srv.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    srv.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16; chapter 04)")
    srv.add_argument("--num-blocks", type=int, default=None,
                     help="KV-cache blocks (default: max-num-seqs full contexts; chapter 04)")
    srv.add_argument("--kv-cache-memory-bytes", type=float, default=None,
                     help="size the KV cache to this many bytes instead of --num-blocks (chapters 02, 04)")
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV blocks of prompt prefixes seen before (default on; chapter 04)")
    srv.add_argument("--max-num-seqs", type=int, default=64,
                     help="most sequences in one forward (default 64; chapter 05)")
    srv.add_argument("--max-num-batched-tokens", type=int, default=512,
                     help="token budget of a step (default 512; chapter 05)")
    srv.add_argument("--enforce-eager", action="store_true",
                     help="run every step eagerly: no CUDA graphs (chapters 02, 05)")
    srv.add_argument("--speculative-model", default=None,
                     help="speculative decoding (chapter 07): a draft model of the same vocabulary (a shipped name "
                          "or a folder), or [ngram] for prompt lookup")
    srv.add_argument("--num-speculative-tokens", type=int, default=None,
                     help="drafts per step with --speculative-model (default 4; chapter 07)")
    srv.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="split every layer over this many processes, one GPU each on CUDA (default 1; chapter 08)")
    srv.add_argument("--disaggregate", action="store_true",
                     help="prefill prompts in one worker process and decode in another, the KV cache sent between "
                          "them (chapter 08; on CUDA a GPU each); the engine flags apply to both workers. Not with "
                          "--speculative-model, --quant, --kv-cache-dtype int8/fp8 or -tp > 1; requests with n or "
                          "best_of > 1 or a response_format get a 400")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters to serve (PEFT folders; chapter 08): a request's model field picks one by "
                          "NAME; /v1/models lists them")
    srv.add_argument("--max-loras", type=int, default=4,
                     help="device slots for LoRA adapters: distinct adapters in one step (default 4)")
    srv.add_argument("--max-lora-rank", type=int, default=None,
                     help="the slots' LoRA rank (default: the largest of --lora-modules)")
    srv.add_argument("--max-queue", type=int, default=256, help="unfinished requests accepted before 429 (default 256)")
    srv.add_argument("--max-body-bytes", type=int, default=16 * 2**20,
                     help="the largest request body accepted; larger ones get 413 (default 16 MiB)")
    srv.add_argument("--timeout-keep-alive", type=float, default=5,
                     help="seconds an idle connection is kept open for its next request (default 5)")
    srv.add_argument("--limit-concurrency", type=int, default=1024,
                     help="open connections and tasks past which new requests get 503 at once, so that slow or idle "
                          "clients cannot hold every socket (default 1024; 0: no limit)")
    srv.add_argument("--shutdown-timeout", type=float, default=30,
                     help="seconds open streams get to finish after SIGTERM before the server stops (default 30)")
    srv.set_defaults(func=cmd_serve)

    exp = sub.add_parser("export", help="write the model as a GGUF file for llama.cpp",
                         description="Write the model as a GGUF file that llama.cpp runs (chapter 06).")
    exp.add_argument("--gguf", required=True, metavar="PATH", help="the .gguf file to write")
    exp.add_argument("--dtype", choices=GGUF_DTYPES, default="q8_0",
                     help="the block linears' type: f32, f16, q8_0 (8.5 bits) or q4_0 (4.5 bits) (default q8_0)")
    exp.add_argument("--model", help=MODEL_HELP)
    exp.set_defaults(func=cmd_export)

    ev = sub.add_parser("eval", help="score a model on the book's tasks; --baseline fails on a quality regression",
                        description="Score a model on the book's local tasks (perplexity, next_line, last_word, "
                                    "agreement with --reference). With --baseline, compare with a results file and "
                                    "exit 1 if a metric moved past its tolerance (chapter 09).")
    ev.add_argument("--model", help=MODEL_HELP)
    ev.add_argument("--tasks", nargs="+", default=["perplexity", "next_line", "last_word"],
                    help="perplexity, agreement, or task files / names in minillm/data/tasks "
                         "(default: perplexity next_line last_word)")
    ev.add_argument("--reference", help="the model the agreement task compares with (top-1 agreement, KL)")
    ev.add_argument("--quant", choices=QUANT_CHOICES, default=None, help=QUANT_HELP)
    ev.add_argument("--group-size", default=None,
                    help="with --quant int4: inputs per scale (default 128), or 'channel' for one scale per output "
                         "channel (int4 without groups)")
    ev.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help=KV_HELP + " (used by the exact-match tasks, which generate through the engine)")
    ev.add_argument("--limit", type=positive_int, default=None,
                    help="the first N documents of each task (perplexity, agreement: N windows; default 64)")
    ev.add_argument("--out", help="write the results as JSON to this file")
    ev.add_argument("--baseline", help="a results file from an earlier run: exit 1 if a metric got worse than its "
                                       "tolerance allows")
    ev.set_defaults(func=cmd_eval)

    from minillm.book.grading.drills import add_drill_command
    from minillm.book.grading.grade import add_grade_command
    from minillm.eval.bench import add_bench_command

    add_grade_command(sub)
    add_drill_command(sub)
    add_bench_command(sub)

    book = sub.add_parser("book", help="maintain the book (exercise notebooks)", description="Maintain the book.")
    book_sub = book.add_subparsers(dest="book_command", metavar="ACTION")
    book_sub.required = True
    ex = book_sub.add_parser("exercises", help="regenerate exercises/ from solutions/",
                             description="Regenerate every written chapter's exercise notebook from its solution.")
    ex.add_argument("--check", action="store_true", help="only check that they are up to date (exit 1 if not)")
    ex.set_defaults(func=cmd_book_exercises)
    return parser


def main(argv: list[str] | None = None, exit_at_once: bool = False) -> int:
    """Run the command `argv` (default: the process's arguments); returns its exit status.

    exit_at_once: for a command marked so (generate: it holds nothing to save or clean up when it is done), end
    the process with `os._exit` once its output is flushed, rather than letting Python tear down every module and
    tensor the OS frees anyway: with PyTorch imported, that teardown alone took 0.7 s of each `minillm generate`
    on this book's CPU. The `minillm` command sets it; tests that call `main` in their own process do not.
    """
    with ctrl_c_exits_at_once():  # building the parser imports the grader's task list, and so PyTorch
        parser = build_parser()
    args = parser.parse_args(argv)
    code = run_command(args)
    if exit_at_once and getattr(args, "exit_at_once", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_command(args: argparse.Namespace) -> int:
    """`args.func(args)`, its errors printed as one line each and turned into exit statuses."""
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError and ConfigError are ValueErrors
        print(f"minillm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # whoever read our output went away (`minillm generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the final flush cannot fail again
        return 141  # 128 + SIGPIPE, as a shell tool ends


def run() -> None:
    """The `minillm` command (the console script and `python -m minillm.cli`)."""
    sys.exit(main(exit_at_once=True))


if __name__ == "__main__":
    run()
