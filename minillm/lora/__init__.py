"""LoRA: many fine-tunes served on one copy of the base weights (chapter 08, issue 32).

    adapter.py   LoRAAdapter; load_adapter / save_adapter in PEFT's format (adapter_config.json +
                 adapter_model.safetensors), checked against the model; merge_adapter / unmerge_adapter
    slots.py     LoRASlots: device slots filled on demand, LRU eviction, pinned while a request runs;
                 LoRALinear: base(x) + each row's update, the batched gather matmul of minillm.kernels.lora
    train.py     train_lora: a LoRA trained with the base model frozen (the shipped shakespeare-11m-lora-menenius);
                 import it from minillm.train.lora_finetune (it needs the training code, which the engine does not)

    from minillm.lora import load_adapter, merge_adapter
    adapter = load_adapter("adapters/pirate", model.config)
    merge_adapter(model, adapter)                  # merged: one adapter, the base model's speed

    llm = LLM(model, tokenizer, lora_modules={"pirate": "adapters/pirate"}, max_loras=4)
    llm.generate(prompts, params, lora="pirate")   # unmerged: each request names its adapter (or none)
"""

from minillm.lora.adapter import (
    TARGETS,
    LoRAAdapter,
    check_finite,
    load_adapter,
    merge_adapter,
    save_adapter,
    target_rows,
    unmerge_adapter,
)
from minillm.lora.slots import LoRALinear, LoRASlots, attach_lora, detach_lora, lora_matmul

__all__ = ["TARGETS", "LoRAAdapter", "LoRALinear", "LoRASlots", "attach_lora", "check_finite", "detach_lora",
           "load_adapter", "lora_matmul", "merge_adapter", "save_adapter", "target_rows", "unmerge_adapter"]
