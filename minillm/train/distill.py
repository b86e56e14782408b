"""Logit distillation in brief: train a small model to match a large one's next-token distributions (chapter 06).

    student, losses = distill(draft, target, train_ids, steps=200)    # a trained copy of the draft
    greedy_agreement(student, target, batches_for_eval(val_ids, 256, 64))   # minillm.train.loop's measure

Hinton, Vinyals and Dean, 2015, "Distilling the Knowledge in a Neural Network" (arXiv:1503.02531):
a next-token label says which token came; the teacher's distribution also says which others were
plausible and by how much, and that is more signal per position than the one-hot label. Both
distributions are softened by a temperature T, p = softmax(z / T), and the student minimises

    L = T^2 * KL(p_teacher || p_student)  = T^2 * sum_v p_t(v) (log p_t(v) - log p_s(v)),

averaged over positions. Its gradient with respect to the student's logits is T (p_s - p_t) per
position; at high T the gap p_s - p_t shrinks like 1/T, so with the T^2 factor the gradient keeps
about the same size whatever T is (Hinton et al.'s reason for it), and T can change without the
learning rate having to. T > 1 lifts the teacher's small probabilities so the
student learns their ranking too; T = 1 matches the distribution the teacher samples from. Hinton
et al. add the ordinary next-token loss with a small weight; here the student sees the teacher only.

The book's example: the shipped draft (`minillm.DEFAULT_DRAFT`, 0.9M parameters) distilled from the
shipped target (`minillm.DEFAULT_MODEL`, 11M) on the *training* sample. What a speculative decoder
cares about is agreement with the target (under greedy verification a draft token is accepted when
it is the target's argmax), so the draft is judged by `minillm.train.loop.greedy_agreement` and by
perplexity, both on the validation sample, and against a control: the same steps, batches and
schedule of plain next-token training (`minillm.train.gqa.uptrain` with `distill_settings(...)`), so that
more training alone is not credited to distillation.

Measured by benchmarks/compression.py (results/compression/cpu.json): 200 steps of 4 x 128
tokens (43 s on one CPU core) raise the draft's greedy agreement with the target on the validation
sample from 57.8% to 61.5%, perplexity 53.6 -> 54.0; the control lowers agreement to 54.0% and
raises perplexity to 60.5. The shipped training sample is small (39k tokens, seen 2.6 times): the
labels alone overfit it at every learning rate tried, while distillation, whose targets are the
teacher's full distributions, did not.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from minillm.model import Transformer
from minillm.train.loop import TrainSettings, lr_at, make_optimizer, optimizer_step, sample_batch

# Sized so that `distill`'s defaults run in under a minute on a CPU core with the shipped pair (most
# of each step is the 11M teacher's forward pass): 200 steps of 4 x 128 tokens, 102k tokens, 2.6
# passes over the 39k-token training sample. lr 3e-4 and T = 1 won a small sweep (1e-4 to 1e-3,
# T = 1 and 2) on validation agreement; the sweep is recorded in results/compression/cpu.json.
DISTILL_STEPS = 200


def distill_settings(
    steps: int = DISTILL_STEPS, lr: float = 3e-4, batch_size: int = 4, seq_len: int = 128, seed: int = 0
) -> TrainSettings:
    """The optimisation settings `distill` uses: warm-up over the first 10% of steps, cosine to lr / 10.

    Pass the same to `minillm.train.gqa.uptrain` for the control (plain next-token training): with the same
    seed it draws the same windows in the same order and follows the same learning-rate schedule.
    """
    return TrainSettings(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, min_lr=lr / 10,
                         warmup=max(1, steps // 10), weight_decay=0.1, dropout=0.0, seed=seed)


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over positions (chapter 06).

    Args:
        student_logits, teacher_logits: [..., vocab], the same shape; the teacher's are treated as
            constants (no gradient flows into the teacher).
        temperature: T > 0.

    Returns:
        a scalar fp32 tensor, >= 0, zero exactly when the two softened distributions are equal.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student and teacher logits must have the same shape [..., vocab], got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    vocab = student_logits.shape[-1]
    log_s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float().reshape(-1, vocab) / temperature, dim=-1)
    kl = F.kl_div(log_s, log_t, reduction="batchmean", log_target=True)  # sum_v p_t (log p_t - log p_s), mean
    return kl * temperature**2


def distill_step(
    student: Transformer, teacher: Transformer, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
    lr: float, temperature: float,
) -> torch.Tensor:
    """One optimiser step of the student towards the teacher on batch [B, T + 1]; returns the loss before it.

    The inputs are batch[:, :-1], exactly what `minillm.train.loop.train_step` feeds the model (its last
    column, the final target, is unused here), through the same `optimizer_step` as `train_step`.
    """
    x = batch[:, :-1].to(student.device)

    def loss() -> torch.Tensor:
        with torch.no_grad():
            target = teacher(x.to(teacher.device)).to(student.device)
        return distillation_loss(student(x), target, temperature)

    return optimizer_step(student, optimizer, lr, loss)


def distill(
    student: Transformer,
    teacher: Transformer,
    ids: torch.Tensor,
    steps: int = DISTILL_STEPS,
    lr: float = 3e-4,
    batch_size: int = 4,
    seq_len: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    progress: bool = False,
) -> tuple[Transformer, list[float]]:
    """Train a copy of `student` to match `teacher`'s next-token distributions on `ids` (chapter 06).

    Windows of seq_len tokens at random places of `ids` (`minillm.train.loop.sample_batch`), AdamW with
    weight decay on matrices (`make_optimizer`), the schedule of `distill_settings`, and
    `distillation_loss` at `temperature`. Seeded: on a CPU the same arguments give the same weights.
    Neither `student` nor `teacher` is modified; the copy is trained in fp32 and returned in eval mode.

    Args:
        student, teacher: minillm models sharing a tokenizer (the same vocabulary).
        ids: [n_tokens] int64 from the TRAINING text (e.g. the tokenized
            `minillm.quant.calibration.sample_text("train")`). Never the validation text: it judges the result.
        steps, lr, batch_size, seq_len, seed: see `distill_settings`.
        temperature: T of `distillation_loss`.
        progress: show a progress bar.

    Returns:
        (the distilled copy, the loss of each step's batch before its update [steps]).
    """
    if student.config.vocab_size != teacher.config.vocab_size:
        raise ValueError(f"student and teacher must share a vocabulary: {student.config.vocab_size} vs "
                         f"{teacher.config.vocab_size} tokens.")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    if len(ids) < seq_len + 2:
        raise ValueError(f"ids has {len(ids)} tokens; a window needs seq_len + 2 = {seq_len + 2}.")
    s = distill_settings(steps, lr, batch_size, seq_len, seed)
    torch.manual_seed(seed)
    student = copy.deepcopy(student).float()
    teacher.eval()
    optimizer = make_optimizer(student, s)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    from tqdm.auto import tqdm  # imported here: in a notebook, after minillm.book.notebook.setup()
    for step in tqdm(range(steps), desc="distilling", disable=not progress):
        batch = sample_batch(ids, s, gen)
        losses.append(distill_step(student, teacher, optimizer, batch, lr_at(step, s), temperature))
    return student.eval(), [loss.item() for loss in losses]
