"""The serving engine (chapters 04-05), in the order a request flows through it:

    sequence.py       Sequence: one completion's whole state (tokens, params, generator, text, stop and DFA state)
    scheduler.py      Scheduler: which sequences run in the next forward, and how many of their tokens
    block_manager.py  BlockAllocator, BlockTable, prefix-cache hashes: which block holds what (no tensors)
    kv_cache.py       PagedKVCache: the pools; PagedCacheView: one forward's view of them
    step_inputs.py    StepInputBuilder: the one place a step's inputs are computed (decode rows kept)
    model_runner.py   ModelRunner: the one place a step runs the model (eager, CUDA graphs, compiled) and samples
    cuda_graphs.py    DecodeGraphs: decode steps captured once and replayed
    compiled_step.py  CompiledDecode: the CPU's counterpart, a decode step compiled ahead of time
    compile_cache.py  compiled steps kept on disk, checked before use; compile_ahead.py fills it (`minillm compile`)
    draft_model.py    DraftModelDrafter: speculative decoding's draft model, on a paged cache of its own (chapter 07)
    engine_config.py  EngineConfig: every setting of an engine but the model and tokenizer, in one object
    llm_engine.py     LLMEngine: step = schedule -> run -> postprocess

    from minillm.engine import EngineConfig, LLMEngine   # LLM, the offline front door over it: minillm.decoding.llm
"""

from minillm.engine.engine_config import EngineConfig
from minillm.engine.llm_engine import LLMEngine, RequestOutput, n_best_by_logprob

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "n_best_by_logprob"]
