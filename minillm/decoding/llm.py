"""`LLM`: offline batch inference, the front door that runs a list of prompts to the end (chapter 05).

    llm = LLM(model, tokenizer)                          # or LLM("shakespeare-11m"), or LLM(model, tokenizer, config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32))   # one RequestOutput per prompt, in order

It builds the engine the way every front door does: the model loaded, an `EngineConfig` made, the tensor-parallel
group started if the config asks for one (`minillm.parallel.tensor.start_group`), then `LLMEngine(model, tokenizer,
config, group=...)`, which composes its cache, scheduler and runner from them. vLLM's `LLM` has this shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minillm.engine.engine_config import EngineConfig
from minillm.engine.llm_engine import LLMEngine, RequestOutput, n_best_by_logprob
from minillm.model import Transformer
from minillm.parallel.tensor import start_group
from minillm.sampler.sampling import SamplingParams
from minillm.tokenizer import Tokenizer


class LLM:
    """Offline batch inference: `LLM(model, tokenizer).generate(prompts, params)` (chapter 05).

    Builds an `LLMEngine` (a config and keyword arguments go to it), adds every prompt, and steps until all are
    done. With `tensor_parallel_size=N` it first starts the tensor-parallel group the engine runs on
    (`minillm.parallel.tensor.TensorParallel`: this process is rank 0, chapter 08).
    """

    def __init__(self, model: Transformer | str, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None, **options: Any) -> None:
        if isinstance(model, str):
            from minillm.checkpoints import load

            model, tokenizer = load(model)
        config = EngineConfig.of(config, **options)
        self.engine = LLMEngine(model, tokenizer, config, group=start_group(model, config))

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (`LLMEngine.shutdown`)."""
        self.engine.shutdown()

    def chat(self, messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer one conversation ([{"role": "user", "content": ...}, ...]) or a list of them: each rendered by the
        model's chat template (`minillm.tokenizer.apply_chat_template`), then generated as `generate` does. A chat
        model ends its turn with its end-of-turn token (SmolLM2's <|im_end|>), which is its EOS."""
        from minillm.tokenizer import apply_chat_template

        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template: pass token ids to generate.")
        single = bool(messages) and isinstance(messages[0], dict)
        chats = [messages] if single else list(messages)
        return self.generate([apply_chat_template(list(chat), tokenizer) for chat in chats], params, use_tqdm)

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """The finished `RequestOutput`s, prompt by prompt in the prompts' order: params.n of them per prompt
        (one unless n > 1; then the n best of best_of by cumulative log-probability). params: one for all, or
        one per prompt. lora: the LoRA adapter (a name given in `lora_modules`) for all, or one per prompt (None:
        the base model; chapter 08)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: pass one, or one each.")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA names for {len(prompts)} prompts: pass one, or one each.")
        engine = self.engine
        ids = [engine.add_request(None, p, sp, lora=name) for p, sp, name in zip(prompts, params, loras)]
        finished = engine.run(use_tqdm, total=len(ids))
        outputs = []
        for request_id, sp in zip(ids, params):
            group = [finished[request_id, i] for i in range(sp.best_of or sp.n)]
            outputs += n_best_by_logprob(group, sp.n)
        return outputs
