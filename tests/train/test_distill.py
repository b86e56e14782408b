"""minillm.train.distill: the distillation loss, its gradient, and a few steps of distillation (chapter 06)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm import ModelConfig, Transformer
from minillm.train.distill import distill, distill_settings, distillation_loss
from minillm.train.gqa import uptrain
from minillm.train.loop import init_weights, sample_batch

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: small models run on one thread


def tiny_model(seed: int, dim: int = 32, n_layers: int = 1, std: float = 0.02) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(dim=dim, n_layers=n_layers, n_heads=2, n_kv_heads=1, head_dim=16,
                                    ffn_dim=2 * dim, vocab_size=VOCAB, max_seq_len=64, norm_eps=1e-5))
    init_weights(model, std=std)
    return model.eval()


def logits(seed: int, shape: tuple[int, ...] = (2, 5, 11)) -> torch.Tensor:
    return 3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
def test_task_1_loss_is_t_squared_kl_zero_only_for_equal_distributions(temperature):
    z_s, z_t = logits(0), logits(1)
    assert distillation_loss(z_t, z_t, temperature).abs() < 1e-6, "identical logits must give zero loss"
    assert distillation_loss(z_t + 5.0, z_t, temperature).abs() < 1e-5, (
        "adding a constant to every logit leaves the distribution, and so the loss, unchanged")
    loss = distillation_loss(z_s, z_t, temperature)
    p_t, p_s = F.softmax(z_t / temperature, -1), F.softmax(z_s / temperature, -1)
    kl = (p_t * (p_t.log() - p_s.log())).sum(-1).mean()  # KL(teacher || student) per position, averaged
    assert loss > 0, "different distributions must give a positive loss"
    torch.testing.assert_close(loss, temperature**2 * kl, msg="the loss must be T^2 KL(p_teacher || p_student)")
    reverse = (p_s * (p_s.log() - p_t.log())).sum(-1).mean()
    assert not torch.isclose(loss, temperature**2 * reverse), "KL's direction: teacher first, KL(p_t || p_s)"


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_task_2_gradient_pulls_the_student_towards_the_teacher(temperature):
    """d loss / d student logits = T (p_s - p_t) / positions; the teacher gets no gradient; a step lowers the loss."""
    z_s = logits(2).requires_grad_()
    z_t = logits(3).requires_grad_()
    loss = distillation_loss(z_s, z_t, temperature)
    loss.backward()
    positions = z_s.shape[0] * z_s.shape[1]
    expected = temperature * (F.softmax(z_s / temperature, -1) - F.softmax(z_t / temperature, -1)) / positions
    torch.testing.assert_close(z_s.grad, expected.detach(), msg="gradient must be T (p_student - p_teacher)")
    assert z_t.grad is None, "the teacher's logits are targets: no gradient may flow into them"
    with torch.no_grad():
        stepped = z_s - 0.5 * positions * z_s.grad
        assert distillation_loss(stepped, z_t, temperature) < loss, "a step against the gradient must lower the loss"
        # It raises the probability of exactly the tokens the teacher favours more than the student does.
        moved = F.softmax(stepped / temperature, -1) - F.softmax(z_s / temperature, -1)
        gap = F.softmax(z_t / temperature, -1) - F.softmax(z_s / temperature, -1)
        assert (moved * gap).sum() > 0


def test_task_3_a_few_steps_move_a_tiny_student_towards_its_teacher():
    teacher, student = tiny_model(0, std=0.1), tiny_model(1)
    ids = torch.randint(2, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))
    held_out = torch.randint(2, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student_before = {k: v.clone() for k, v in student.state_dict().items()}

    def kl(model: Transformer) -> float:
        with torch.no_grad():
            return distillation_loss(model(held_out), teacher(held_out)).item()

    start = kl(student)
    trained, losses = distill(student, teacher, ids, steps=40, lr=1e-2, batch_size=8, seq_len=32)
    assert len(losses) == 40 and all(loss >= 0 for loss in losses)
    end = kl(trained)
    assert end < 0.5 * start, (
        f"40 steps of distillation must at least halve the KL to the teacher: {start:.3f} -> {end:.3f}")
    assert sum(losses[-5:]) < sum(losses[:5]), "the training loss must fall"
    for name, t in teacher.state_dict().items():
        assert torch.equal(t, teacher_before[name]), f"distill changed the teacher's {name}"
    for name, t in student.state_dict().items():
        assert torch.equal(t, student_before[name]), f"distill must train a copy; it changed the student's {name}"
    again, _ = distill(student, teacher, ids, steps=40, lr=1e-2, batch_size=8, seq_len=32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), trained.state_dict().values())), \
        "distill is seeded: the same arguments must give the same weights"


def test_task_4_the_control_sees_the_same_windows_and_schedule():
    """uptrain(..., distill_settings(...)) draws the windows distill draws, so the comparison is fair."""
    s = distill_settings(steps=50, lr=1e-3, batch_size=3, seq_len=16, seed=7)
    assert (s.steps, s.lr, s.batch_size, s.seq_len, s.seed, s.min_lr, s.warmup) == (50, 1e-3, 3, 16, 7, 1e-4, 5)
    ids = torch.arange(1000)
    a, b = torch.Generator().manual_seed(s.seed), torch.Generator().manual_seed(s.seed)
    assert all(torch.equal(sample_batch(ids, s, a), sample_batch(ids, s, b)) for _ in range(5))
    model = tiny_model(0)
    control, losses = uptrain(model, torch.randint(2, VOCAB, (500,)), 3, distill_settings(3, 1e-3, 2, 16))
    assert len(losses) == 3 and control is not model


def test_task_5_bad_arguments_raise():
    a, b = tiny_model(0), tiny_model(1)
    with pytest.raises(ValueError, match="same shape"):
        distillation_loss(torch.zeros(2, 5), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="temperature must be positive"):
        distillation_loss(torch.zeros(2, 5), torch.zeros(2, 5), 0.0)
    with pytest.raises(ValueError, match="a window needs"):
        distill(a, b, torch.arange(10), steps=1, seq_len=32)
    other = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                                    vocab_size=VOCAB + 1, max_seq_len=64))
    with pytest.raises(ValueError, match="share a vocabulary"):
        distill(a, other, torch.arange(100), steps=1, seq_len=8)
