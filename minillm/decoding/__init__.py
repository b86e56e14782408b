"""The front doors over the engine: ways to ask a model for text (chapters 01 and 02).

    minillm.decoding.llm                 LLM: offline batch inference, a list of prompts run to the end (chapter 05)
    minillm.decoding.generation          generate, generate_stream, generate_constrained; chapter 02's no-cache loop
    minillm.decoding.parallel_sampling   generate_n: n completions of one prompt, the best of best_of
    minillm.decoding.beam                beam search
    minillm.decoding.inference_scaling   best-of-N with a scorer, self-consistency (majority vote)

Each calls the engine (`minillm.engine.LLMEngine.step`) or one of its step variants; the engine never imports them.
"""
