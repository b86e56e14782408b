"""From logits to tokens: how the next token is chosen (chapters 01 and 07).

    minillm.sampler.sampling      SamplingParams and sample(): temperature, top-k/p, min-p, penalties, logprobs
    minillm.sampler.constrained   constrained decoding: a regex or JSON schema as an automaton over token ids
    minillm.sampler.speculative   speculative decoding: drafters and the acceptance rules of draft-and-verify

The engine (`minillm.engine`) samples through these; they import nothing of it. Import the submodule you need.
"""
