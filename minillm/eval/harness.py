"""minillm as a model of lm-evaluation-harness (lm-eval), and the book's tasks as lm-eval tasks (chapter 09).

`minillm.eval.tasks` scores the book's task files the way lm-eval does; this module lets lm-eval itself do it,
so any of lm-eval's tasks can score a minillm model, and the book's numbers can be checked against lm-eval's.
It needs lm-eval (`pip install lm-eval`); the rest of minillm does not, so `minillm.eval` does not import it.

`MinillmLM` answers lm-eval's three request types:

- `loglikelihood`: (context, continuation) -> (summed log-probability, is_greedy), by `tasks.loglikelihood`,
  so it splits the text into context and continuation tokens exactly as the book's own scoring does;
- `loglikelihood_rolling`: a whole text's log-probability, after a BOS token, in windows of the model's context
  (each token is predicted once, the last window with a full context: lm-eval's rule for perplexity tasks);
- `generate_until`: greedy generation until a stop string, through the engine (`minillm.LLM`), as
  `tasks.exact_match` does.

The book's tasks as lm-eval tasks are in minillm/data/tasks/lm_eval/ (`YAML_DIR`): minillm_next_line (multiple
choice: acc, acc_norm) and minillm_last_word (exact_match of the generation's first word). They read the
book's JSON-lines files through `book_task`, not from the Hugging Face hub, so they run offline:

    import lm_eval
    from lm_eval.tasks import TaskManager
    from minillm.eval.harness import YAML_DIR, MinillmLM

    results = lm_eval.simple_evaluate(
        model=MinillmLM("shakespeare-11m"), tasks=["minillm_next_line", "minillm_last_word"],
        task_manager=TaskManager(include_path=str(YAML_DIR), include_defaults=False))
    print(results["results"])   # {"minillm_next_line": {"acc,none": ..., "acc_norm,none": ...}, ...}

Importing this module registers the model as "minillm", so lm-eval's command line finds it when run through
this module (`lm_eval --model minillm` alone does not import it):

    python -m minillm.eval.harness run --model minillm --model_args pretrained=shakespeare-11m \\
        --include_path minillm/data/tasks/lm_eval --tasks minillm_next_line,minillm_last_word
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

try:
    import lm_eval.models  # noqa: F401 - lm-eval's own models; its registry imports them only while it is empty
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:
    raise ImportError("minillm.eval.harness needs lm-evaluation-harness: pip install lm-eval "
                      f"(or pip install -e '.[dev]'); importing it failed with: {e}") from e

from minillm.eval.tasks import TASKS_DIR, load_task, loglikelihood
from minillm.model import Transformer
from minillm.shipped import DEFAULT_MODEL
from minillm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from datasets import Dataset
    from lm_eval.api.instance import Instance

YAML_DIR = TASKS_DIR / "lm_eval"  # the book's tasks as lm-eval task configs: TaskManager(include_path=...)


class MinillmLM(LM):
    """A minillm model (and its tokenizer) behind lm-eval's model interface.

    pretrained: a shipped model's name or a model folder (`minillm.load`), or a loaded `Transformer`, then with
    its `tokenizer`. device: where to load it (default: CUDA if there is one; a CUDA device without one means the
    CPU). batch_size: rows per forward pass when scoring. max_gen_toks: the longest generation when a task does
    not say. lm-eval also passes max_batch_size, which is not used.
    """

    def __init__(self, pretrained: str | Transformer = DEFAULT_MODEL, tokenizer: Tokenizer | None = None,
                 device: str | None = None, batch_size: int | str = 16, max_gen_toks: int = 256,
                 max_batch_size: int | None = None) -> None:
        super().__init__()
        if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
            device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's command line asks for cuda:0
        if isinstance(pretrained, str):
            from minillm.checkpoints import load

            pretrained, tokenizer = load(pretrained, device=device)
        if tokenizer is None:
            raise ValueError("lm-eval sends text: pass the model's tokenizer, or a name or folder that has one.")
        self.model, self.tokenizer = pretrained.eval(), tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16  # lm-eval may pass "auto"
        self.max_gen_toks = int(max_gen_toks)
        self._llm = None  # the engine, built on the first generate_until

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) for each request's (context, continuation)."""
        out = loglikelihood(self.model, self.tokenizer, [r.args for r in requests], self.batch_size)
        for request, result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return out

    @torch.no_grad()
    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        """log p(text) of each request's (text,), every token predicted once, the first one after BOS.

        The tokens are scored in windows of the model's context L: window k predicts tokens kL+1 .. (k+1)L from
        the L tokens before each of them, so no token is scored twice and the last window, which predicts what
        is left, still sees a full context (lm-eval's rule). `minillm.eval.perplexity` differs: it scores a
        corpus in windows that each start afresh, without BOS, and leaves each window's first token unscored.
        """
        L = self.model.config.max_seq_len
        prefix = self.tokenizer.bos_token_id
        if prefix is None:
            prefix = self.tokenizer.eos_token_ids[0]
        out = []
        for request in requests:
            (text,) = request.args
            ids = torch.tensor([prefix, *self.tokenizer.encode(text, add_special_tokens=False)])
            total = 0.0
            for start in range(1, len(ids), L):  # ids[start:end] are predicted in this window
                end = min(start + L, len(ids))
                inputs = ids[max(0, end - 1 - L) : end - 1]
                logprobs = F.log_softmax(self.model(inputs[None].to(self.model.device)).float()[0], dim=-1).cpu()
                total += logprobs[-(end - start) :].gather(-1, ids[start:end, None]).sum().item()
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            out.append(total)
        return out

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Greedy continuations of each request's (context, gen_kwargs), cut before the first stop string
        (gen_kwargs["until"]), at most gen_kwargs["max_gen_toks"] tokens. The context is cut on the left to
        leave room for them in the model's context, as lm-eval's own models do."""
        from minillm.decoding.llm import LLM
        from minillm.sampler.sampling import SamplingParams

        if self._llm is None:
            self._llm = LLM(self.model, self.tokenizer)
        prompts, params = [], []
        for context, gen_kwargs in (r.args for r in requests):
            if gen_kwargs.get("do_sample") and gen_kwargs.get("temperature", 1.0) > 0:
                raise ValueError(f"this task asks to sample ({gen_kwargs}), and MinillmLM decodes greedily only: "
                                 "run it with do_sample: false (or temperature: 0) in the task's generation_kwargs, "
                                 "or sample with minillm.LLM.generate directly.")
            max_tokens = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            until = gen_kwargs.get("until") or []
            room = self.model.config.max_seq_len - max_tokens
            prompts.append(self.tokenizer.encode(context)[-room:])
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         stop=[until] if isinstance(until, str) else list(until)))
        texts = [o.text for o in self._llm.generate(prompts, params, use_tqdm=False)]
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts


def book_task(task_file: str | Path, **metadata: object) -> dict[str, Dataset]:
    """One of the book's task files (a name such as "next_line", or a path) as a dataset with one split, "test".

    The task YAMLs in `YAML_DIR` load their documents with it (lm-eval's `custom_dataset`, which also passes the
    task's metadata, unused here), so lm-eval reads the book's files, checked by `load_task`, and nothing from
    the hub."""
    from datasets import Dataset

    return {"test": Dataset.from_list(load_task(task_file).docs)}


if __name__ == "__main__":
    # `python -m minillm.eval.harness ...`: lm-eval's command line, with "minillm" registered. This file then runs as
    # __main__, a second copy of the module; only the importable copy registers, or lm-eval would see two "minillm"s.
    from lm_eval.__main__ import cli_evaluate

    import minillm.eval.harness  # noqa: F401

    cli_evaluate()
else:
    register_model("minillm")(MinillmLM)
