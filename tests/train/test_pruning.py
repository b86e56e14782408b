"""minillm.train.pruning: unstructured and 2:4 masks, Wanda's score, pruning a model in place (chapter 06)."""

from __future__ import annotations

import copy

import pytest
import torch

import minillm
from minillm import ModelConfig, Transformer
from minillm.eval import perplexity
from minillm.quant import block_linears, quantize
from minillm.quant.calibration import calibration_ids, capture_inputs, validation_ids
from minillm.train.loop import init_weights
from minillm.train.pruning import magnitude_prune, prune, prune_2_4, sparsity_of, wanda_scores

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: small models run on one thread


def random_model(seed: int = 0, n_layers: int = 2) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                                    vocab_size=128, max_seq_len=64, norm_eps=1e-5))
    init_weights(model, std=0.1)
    return model.eval()


def random_weight(rows: int = 16, cols: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 0.75, 0.9])
def test_task_1_magnitude_prune_zeroes_the_smallest_of_each_row(sparsity):
    w = random_weight()
    pruned, mask = magnitude_prune(w, sparsity)
    n_zero = round(sparsity * w.shape[1])
    assert mask.dtype == torch.bool and mask.shape == w.shape
    assert torch.equal(pruned, w * mask), "the pruned weight must be the weight times its mask"
    zeros_per_row = (~mask).sum(1)
    assert (zeros_per_row == n_zero).all(), (
        f"sparsity {sparsity} of {w.shape[1]} columns must zero exactly {n_zero} weights in every row; "
        f"rows zeroed {zeros_per_row.tolist()}")
    for r in range(w.shape[0]):
        kept, dropped = w[r][mask[r]].abs(), w[r][~mask[r]].abs()
        if len(kept) and len(dropped):
            assert dropped.max() <= kept.min(), (
                f"row {r}: pruned a weight of |w| = {dropped.max():.3f} while keeping one of |w| = {kept.min():.3f}")
    assert abs((pruned == 0).float().mean().item() - n_zero / w.shape[1]) < 1e-9


def test_task_2_prune_2_4_keeps_the_two_largest_of_every_four():
    w = random_weight(8, 32, seed=1).to(torch.bfloat16)
    pruned, mask = prune_2_4(w)
    assert pruned.dtype == torch.bfloat16 and torch.equal(pruned, w * mask)
    per_group = mask.reshape(8, 8, 4).sum(-1)
    assert (per_group == 2).all(), f"every group of 4 inputs must keep exactly 2 weights, kept {per_group.unique()}"
    groups = w.float().abs().reshape(8, 8, 4)
    for r in range(8):
        for g in range(8):
            largest = set(groups[r, g].argsort(descending=True)[:2].tolist())
            kept = set(mask.reshape(8, 8, 4)[r, g].nonzero().flatten().tolist())
            assert kept == largest, f"row {r}, group {g}: |w| = {groups[r, g].tolist()}, kept {kept}, not {largest}"
    assert (pruned == 0).float().mean() == 0.5
    with pytest.raises(ValueError, match="multiple of 4"):
        prune_2_4(torch.randn(4, 6))


def test_task_3_wanda_ranks_by_weight_times_input_norm():
    """A small weight on a loud input outranks a larger weight on a quiet one."""
    w = torch.tensor([[0.1, 1.0, 0.2, 0.9]])
    norms = torch.tensor([100.0, 1.0, 1.0, 1.0])
    s = wanda_scores(w, norms)
    assert torch.allclose(s, torch.tensor([[10.0, 1.0, 0.2, 0.9]]))
    assert prune_2_4(w)[1].tolist() == [[False, True, False, True]], "magnitude keeps the two largest |w|"
    assert prune_2_4(w, s)[1].tolist() == [[True, True, False, False]], "wanda keeps the two largest |w| * ||x||"
    assert magnitude_prune(w, 0.5, s)[1].tolist() == [[True, True, False, False]]
    with pytest.raises(ValueError, match="one input norm per input column"):
        wanda_scores(w, torch.ones(3))


def test_task_4_wanda_input_norms_come_from_the_calibration_tokens():
    """With one block, prune(scores="wanda") must equal scoring each linear by the L2 norms of its captured inputs."""
    model = random_model(n_layers=1)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    inputs = capture_inputs(model, ids, block_linears(model))
    expected = {name: prune_2_4(linear.weight, wanda_scores(linear.weight, inputs[name].norm(dim=0)))[0]
                for name, linear in block_linears(model).items()}
    prune(model, "2:4", calibration=ids, scores="wanda")
    for name, linear in block_linears(model).items():
        assert torch.equal(linear.weight, expected[name]), f"{name}: wanda masks differ from |w| * ||X_j||"


@pytest.mark.parametrize("method, scores", [("unstructured", "magnitude"), ("2:4", "magnitude"),
                                            ("unstructured", "wanda"), ("2:4", "wanda")])
def test_task_5_prune_changes_only_the_block_linears(method, scores):
    model = random_model()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    assert prune(model, method, 0.5, ids if scores == "wanda" else None, scores=scores) is model
    linears = {f"{name}.weight" for name in block_linears(model)}
    assert len(linears) == 4 * model.config.n_layers  # qkv, o, gate_up, down per block
    for name, t in model.state_dict().items():
        if name in linears:
            assert (t == 0).float().mean() == 0.5, f"{name}: sparsity {(t == 0).float().mean():.3f}, expected 0.5"
            assert torch.equal(t[t != 0], before[name][t != 0]), f"{name}: the kept weights must keep their values"
            if method == "2:4":
                assert ((t != 0).reshape(t.shape[0], -1, 4).sum(-1) == 2).all(), f"{name} is not 2:4"
        else:
            assert torch.equal(t, before[name]), f"{name} is not a block linear, yet prune changed it"
    assert sparsity_of(model) == 0.5


def test_task_6_perplexity_rises_with_sparsity_on_the_shipped_draft():
    """Shipped draft, 8 validation windows of 256 tokens. Measured (CPU, fp32): dense 43.9; magnitude
    25% 44.2, 50% 54.8, 75% 235; 50% Wanda 52.8; 2:4 magnitude 81.2, 2:4 Wanda 70.2."""
    draft, tok = minillm.load(minillm.DEFAULT_DRAFT)
    val = validation_ids(tok)
    calibration = calibration_ids(tok, n_seqs=8)

    def ppl_after(method: str = "unstructured", sparsity: float = 0.5, scores: str = "magnitude") -> float:
        model = copy.deepcopy(draft)
        prune(model, method, sparsity, calibration, scores=scores)
        assert sparsity_of(model) == pytest.approx(sparsity, abs=2e-3)
        return perplexity(model, val, max_windows=8)

    dense = perplexity(draft, val, max_windows=8)
    sweep = [dense] + [ppl_after(sparsity=s) for s in (0.25, 0.5, 0.75)]
    assert sweep == sorted(sweep), f"magnitude pruning at 0/25/50/75% must raise perplexity step by step: {sweep}"
    wanda, mag_24, wanda_24 = ppl_after(scores="wanda"), ppl_after("2:4"), ppl_after("2:4", scores="wanda")
    numbers = (f"dense {dense:.1f}, 50% magnitude {sweep[2]:.1f}, 50% wanda {wanda:.1f}, "
               f"2:4 magnitude {mag_24:.1f}, 2:4 wanda {wanda_24:.1f}")
    assert dense < min(wanda, mag_24, wanda_24), numbers
    assert mag_24 > sweep[2] and wanda_24 > wanda, f"2:4 constrains where the zeros go, so costs more: {numbers}"
    assert wanda_24 < mag_24, f"on this model Wanda's score should beat magnitude under 2:4: {numbers}"


def test_task_7_bad_arguments_raise_with_a_remedy():
    model = random_model()
    with pytest.raises(ValueError, match="choose one of"):
        prune(model, "random")
    with pytest.raises(ValueError, match="choose one of"):
        prune(model, "2:4", scores="taylor")
    with pytest.raises(ValueError, match="pass 0.5"):
        prune(model, "2:4", sparsity=0.75)
    with pytest.raises(ValueError, match="calibration"):
        prune(model, scores="wanda")
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        magnitude_prune(torch.randn(2, 4), 1.0)
    quantize(model, "rtn", bits=8)
    with pytest.raises(ValueError, match="prune first"):
        prune(model)
