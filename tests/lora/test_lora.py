"""LoRA adapters (issue 32, chapter 08): PEFT's format, merged and unmerged, many adapters in one batch.

Parity is against `peft`'s `PeftModel` over the `transformers` model, on the CPU, for a random Llama-shape model
and for the shipped model. The batched LoRA kernel runs through Triton's CPU interpreter (TRITON_INTERPRET=1,
set before anything imports triton, as tests/kernels/test_kernels.py does), on small shapes.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede every import of minillm.kernels: Triton reads it when @triton.jit decorates
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import random_hf_model  # noqa: E402
from minillm.kernels import add_lora_gathered, add_lora_reference  # noqa: E402

import minillm  # noqa: E402
from minillm.decoding.llm import LLM  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.lora import (  # noqa: E402
    LoRALinear,
    LoRASlots,
    attach_lora,
    detach_lora,
    load_adapter,
    merge_adapter,
    save_adapter,
    unmerge_adapter,
)
from minillm.sampler.sampling import SamplingParams  # noqa: E402

peft = pytest.importorskip("peft")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ADAPTERS = {  # name: (seed, target modules, rank, alpha, rsLoRA)
    "qv": (1, ["q_proj", "v_proj"], 4, 8, False),
    "mlp": (2, ["gate_proj", "down_proj"], 8, 16, False),
    "all": (3, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2, 4, True),
    "ko": (4, ["k_proj", "o_proj", "up_proj"], 4, 4, False),
}


def make_peft_adapter(hf_model, folder, seed: int, targets: list[str], r: int, alpha: float, rslora: bool,
                      std: float = 0.1):
    """A random PEFT LoRA over `hf_model` with nonzero B, saved to `folder`; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.05, use_rslora=rslora)
    model = get_peft_model(hf_model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.normal_(0, std)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_file):
    """A random Llama checkpoint, minillm's load of it, and the four adapters of ADAPTERS saved in PEFT's format
    with their PeftModel logits on one prompt."""
    root = tmp_path_factory.mktemp("lora")
    hf = random_hf_model("llama")
    hf.save_pretrained(root / "base")
    (root / "base" / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    prompt = torch.tensor([[0, 5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    expected = {}
    for name, (seed, targets, r, alpha, rslora) in ADAPTERS.items():
        fresh = random_hf_model("llama")
        peft_model = make_peft_adapter(fresh, root / name, seed, targets, r, alpha, rslora)
        with torch.no_grad():
            expected[name] = peft_model(prompt).logits[0].float()
    with torch.no_grad():
        expected[None] = hf(prompt).logits[0].float()
    return root, prompt, expected


def fresh_model(root):
    model, tokenizer = minillm.load(str(root / "base"), dtype=torch.float32)
    return model, tokenizer


# ---------------------------------------------------------------------- format, parity, merge
def test_task_1_unmerged_logits_equal_peft(llama, one_thread):
    """Each adapter's logits, through LoRASlots + LoRALinear, equal PeftModel's over transformers."""
    root, prompt, expected = llama
    model, _ = fresh_model(root)
    slots = LoRASlots(model, max_loras=2, max_rank=8)
    attach_lora(model, slots)
    for name in ADAPTERS:
        slots.register(name, load_adapter(root / name, model.config))
        assert slots.acquire(name)
        with torch.no_grad(), slots.rows([name]):
            got = model(prompt)[0]
        slots.release(name)
        torch.testing.assert_close(got, expected[name], atol=2e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"adapter {n!r}: minillm != peft: {m}")
    with torch.no_grad():  # outside `rows`, a LoRALinear is its base layer
        torch.testing.assert_close(model(prompt)[0], expected[None], atol=2e-4, rtol=1e-4)
    assert slots.evictions == 2, "4 adapters through 2 slots, one at a time, evict twice"
    detach_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def test_task_2_merged_equals_unmerged_and_unmerge_restores(llama, one_thread):
    root, prompt, expected = llama
    model, _ = fresh_model(root)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for name in ADAPTERS:
        adapter = load_adapter(root / name, model.config)
        merge_adapter(model, adapter)
        with torch.no_grad():
            torch.testing.assert_close(model(prompt)[0], expected[name], atol=2e-4, rtol=1e-4)
        unmerge_adapter(model, adapter)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-6, rtol=0, msg=f"unmerge left {k} changed")


def test_task_3_qv_adapter_touches_only_its_row_slices(llama):
    root, _, _ = llama
    model, _ = fresh_model(root)
    qkv = model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    gate_up = model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    merge_adapter(model, load_adapter(root / "qv", model.config))
    changed = (model.layers[0].self_attn.qkv_proj.weight != qkv).any(dim=1)
    q, kv = model.config.n_heads * model.config.head_dim, model.config.n_kv_heads * model.config.head_dim
    assert changed[:q].all() and not changed[q : q + kv].any() and changed[q + kv :].all(), \
        "a q_proj+v_proj adapter must change exactly q's rows and v's rows of qkv_proj, never k's"
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, gate_up)


def test_task_4_save_round_trips_and_peft_loads_ours(llama, tmp_path):
    from peft import PeftModel

    root, prompt, expected = llama
    model, _ = fresh_model(root)
    adapter = load_adapter(root / "all", model.config)
    save_adapter(adapter, tmp_path / "copy")
    again = load_adapter(tmp_path / "copy", model.config)
    assert again.rank == adapter.rank and again.use_rslora and again.targets == adapter.targets
    hf = PeftModel.from_pretrained(random_hf_model("llama"), tmp_path / "copy").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(prompt).logits[0], expected["all"], atol=1e-5, rtol=1e-5)


def test_task_5_shipped_model_equals_peft(tmp_path, one_thread):
    """The shipped Shakespeare model with a random adapter: minillm unmerged (and merged) == PeftModel."""
    import transformers

    from minillm.shipped import DEFAULT_MODEL

    model, tokenizer = minillm.load(DEFAULT_MODEL, dtype=torch.float32)
    folder = os.path.join(os.path.dirname(minillm.__file__), "models", DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    peft_model = make_peft_adapter(hf, tmp_path / "a", 7, ["q_proj", "v_proj", "down_proj"], 8, 16, False, std=0.05)
    prompt = torch.tensor([tokenizer.encode("ROMEO: But soft, what light")])
    with torch.no_grad():
        want = peft_model(prompt).logits[0]
    slots = LoRASlots(model, max_loras=1, max_rank=8)
    attach_lora(model, slots)
    slots.register("a", load_adapter(tmp_path / "a", model.config))
    slots.acquire("a")
    with torch.no_grad(), slots.rows(["a"]):
        got = model(prompt)[0]
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4)
    detach_lora(model)
    merge_adapter(model, load_adapter(tmp_path / "a", model.config))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt)[0], want, atol=5e-4, rtol=1e-4)


# ---------------------------------------------------------------------- bad adapters
def corrupt(folder, tmp_path, name, change):
    out = tmp_path / name
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    change(out)
    return out


def edit_config(**changes):
    def change(folder):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(changes)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return change


@pytest.mark.parametrize("case, match", [
    ("missing weights", "adapter_model.safetensors is missing"),
    ("corrupt weights", "cannot be read"),
    ("corrupt config", "not valid JSON"),
    ("unknown target", "unknown target module"),
    ("rank mismatch", "rank 4 .* r=8"),
    ("dora", "DoRA"),
])
def test_task_6_bad_adapters_are_refused_by_name(llama, tmp_path, case, match):
    root, _, _ = llama
    model, _ = fresh_model(root)
    change = {
        "missing weights": lambda f: (f / "adapter_model.safetensors").unlink(),
        "corrupt weights": lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10),
        "corrupt config": lambda f: (f / "adapter_config.json").write_text("{not json"),
        "unknown target": edit_config(target_modules=["q_proj", "lm_head"]),
        "rank mismatch": edit_config(r=8),
        "dora": edit_config(use_dora=True),
    }[case]
    with pytest.raises(ValueError, match=match):
        load_adapter(corrupt(root / "qv", tmp_path, "bad", change), model.config)


def test_task_7_adapter_for_another_model_size_is_refused(llama, tmp_path):
    root, _, _ = llama
    bigger = random_hf_model("llama", hidden_size=96)
    make_peft_adapter(bigger, tmp_path / "big", 0, ["q_proj"], 4, 8, False)
    model, _ = fresh_model(root)
    with pytest.raises(ValueError, match="another model size"):
        load_adapter(tmp_path / "big", model.config)
    deeper = random_hf_model("llama", num_hidden_layers=3)
    make_peft_adapter(deeper, tmp_path / "deep", 0, ["q_proj"], 4, 8, False)
    with pytest.raises(ValueError, match="layer 2, the model 2 layers"):
        load_adapter(tmp_path / "deep", model.config)
    with pytest.raises(ValueError, match="no such folder"):
        LLMEngine(model, lora_modules={"x": str(tmp_path / "nowhere")})


# ---------------------------------------------------------------------- the engine: many adapters in one batch
def test_task_8_mixed_batch_gives_each_row_what_it_gets_alone(llama, one_thread):
    """8 prompts, 4 adapters and base rows in one batch: each row's greedy tokens and logprobs are what it gets
    in an engine of its own."""
    root, _, _ = llama
    model, tok = fresh_model(root)
    modules = {name: str(root / name) for name in ADAPTERS}
    prompts = [[0, 5, 17, 99, 3, 250, 42, 7], [0, 9, 9, 9], [0, 12, 30], [0, 5, 17, 99, 3, 250, 42, 7],
               [0, 44, 45, 46, 47, 48], [0, 5, 17, 99], [0, 100, 101], [0, 5, 17, 99, 3, 250, 42, 7]]
    loras = ["qv", None, "mlp", "all", "ko", "qv", None, None]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    llm = LLM(model, tok, lora_modules=modules, max_loras=4, max_num_seqs=8)
    together = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    for p, name, out in zip(prompts, loras, together):
        alone = LLM(model, tok, lora_modules=modules, max_loras=1).generate([p], params, use_tqdm=False,
                                                                             lora=name)[0]
        assert out.token_ids == alone.token_ids, f"row under {name!r} differs in a mixed batch from alone"
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)
    base = LLM(model, tok).generate(prompts, params, use_tqdm=False)
    assert any(a.token_ids != b.token_ids for a, b, n in zip(together, base, loras) if n), \
        "adapters with B != 0 should change some greedy continuation"
    assert all(a.token_ids == b.token_ids for a, b, n in zip(together, base, loras) if n is None), \
        "base rows in a LoRA batch must generate what the base model generates"


def test_task_9_slots_evict_lru_never_a_pinned_one(llama):
    root, _, _ = llama
    model, _ = fresh_model(root)
    slots = LoRASlots(model, max_loras=2, max_rank=8)
    for name in ADAPTERS:
        slots.register(name, load_adapter(root / name, model.config))
    assert slots.acquire("qv") and slots.acquire("mlp")
    assert not slots.acquire("all"), "both slots are pinned by running requests: nothing may be evicted"
    slots.release("qv")
    assert slots.acquire("all") and "qv" not in slots.resident and slots.evictions == 1
    slots.release("mlp")
    slots.release("all")
    assert slots.acquire("all") and slots.loads == 3, "a resident adapter is not loaded again"
    slots.release("all")
    assert slots.acquire("ko") and "mlp" not in slots.resident, "the least recently used one goes first"
    with pytest.raises(ValueError, match="rank 8, more than the slots' max_rank 4"):
        LoRASlots(model, 1, 4).register("mlp", load_adapter(root / "mlp", model.config))


def test_task_10_scheduler_waits_for_a_lora_slot(llama, one_thread):
    """One slot, two adapters: the second adapter's request waits (with the reason), then runs; requests behind it
    whose adapter is resident (or that use none) pass it; one that needs a slot too waits."""
    root, _, _ = llama
    model, tok = fresh_model(root)
    modules = {"qv": str(root / "qv"), "mlp": str(root / "mlp"), "ko": str(root / "ko")}
    engine = LLMEngine(model, tok, lora_modules=modules, max_loras=1)
    engine.add_request("a", [0, 5, 6], GREEDY, lora="qv")
    engine.add_request("b", [0, 7, 8], GREEDY, lora="mlp")
    engine.add_request("c", [0, 9, 10], GREEDY)  # base: passes b
    engine.add_request("d", [0, 11, 12], GREEDY, lora="qv")  # resident: passes b
    engine.add_request("e", [0, 13, 14], GREEDY, lora="ko")  # needs a slot too: waits
    engine.step()
    assert engine.last_step.waiting == {"b": "no free LoRA slot", "e": "no free LoRA slot"}
    assert {s.seq_id for s, _ in engine.last_step.scheduled} == {"a", "c", "d"}
    done = engine.run()
    assert {k[0] for k in done} == {"a", "b", "c", "d", "e"} and engine.lora_slots.evictions == 2
    assert sum(engine.lora_slots.pins.values()) == 0, "finished requests must unpin their slots"
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'; this engine serves \['ko', 'mlp', 'qv'\]"):
        engine.add_request("d", [0, 1], GREEDY, lora="nope")


def test_task_11_prefix_cache_is_not_shared_across_adapters(llama, one_thread):
    root, _, _ = llama
    model, tok = fresh_model(root)
    engine = LLMEngine(model, tok, lora_modules={"qv": str(root / "qv"), "mlp": str(root / "mlp")})
    prompt = list(range(2, 40))  # two full blocks of 16 reusable
    allocator = engine.cache.allocator
    for i, name in enumerate(["qv", "mlp", None, "qv"]):
        engine.add_request(str(i), prompt, GREEDY, lora=name)
        engine.run()
    assert allocator.hits == 2, (f"only the second 'qv' request may reuse blocks (2 of them); got {allocator.hits} "
                                 "hits: blocks computed under one adapter were reused for another")
    out = LLM(model, tok, lora_modules={"qv": str(root / "qv")}, enable_prefix_caching=False).generate(
        [prompt], GREEDY, use_tqdm=False, lora="qv")[0]
    engine.add_request("again", prompt, GREEDY, lora="qv")
    assert engine.run()["again", 0].token_ids == out.token_ids


# ---------------------------------------------------------------------- the kernel
def test_task_12_references_agree():
    torch.manual_seed(0)
    N, d_in, d_out, S, r = 13, 24, 40, 3, 5
    x, a, b = torch.randn(N, d_in), torch.randn(S, r, d_in), torch.randn(S, d_out, r)
    ids = torch.tensor([0, -1, 2, 2, 1, -1, 0, 0, 1, 2, -1, 1, 0])
    y0 = torch.randn(N, d_out)
    want = y0.clone()
    for n in range(N):
        if ids[n] >= 0:
            want[n] += b[ids[n]] @ (a[ids[n]] @ x[n])
    torch.testing.assert_close(add_lora_reference(y0.clone(), x, a, b, ids), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(add_lora_gathered(y0.clone(), x, a, b, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, d_in, d_out, r", [(5, 32, 48, 4), (7, 40, 130, 16)])
def test_task_13_triton_kernel_equals_reference(dtype, N, d_in, d_out, r):
    pytest.importorskip("triton")
    from minillm.kernels import add_lora

    if not CUDA and sys.modules["minillm.kernels.lora"]._interpreted() is False:
        pytest.skip("minillm.kernels was imported before TRITON_INTERPRET=1: run this file on its own")
    device = "cuda" if CUDA else "cpu"
    torch.manual_seed(N)
    S = 3
    x = torch.randn(N, d_in, device=device).to(dtype)
    a = (0.2 * torch.randn(S, r, d_in, device=device)).to(dtype)
    b = (0.2 * torch.randn(S, d_out + 8, r, device=device)).to(dtype)[:, 4 : 4 + d_out]  # a strided slice of B
    ids = torch.randint(-1, S, (N,), device=device)
    wide = torch.randn(N, d_out + 10, device=device).to(dtype)  # y: a column slice of a wider output
    want = add_lora_reference(wide.float().clone()[:, 3 : 3 + d_out], x.float(), a.float(), b.float(), ids)
    got = add_lora(wide[:, 3 : 3 + d_out], x, a, b, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.data_ptr() == wide[:, 3:].data_ptr(), "add_lora adds into y in place"
