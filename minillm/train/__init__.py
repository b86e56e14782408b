"""Making and changing models: training and model surgery, all offline on the shipped corpus.

    minillm.train.loop          how the shipped models were trained (chapter 00)
    minillm.train.corpus        the Shakespeare corpus they are trained on (chapter 00)
    minillm.train.gqa           from multi-head to grouped-query attention: pool K/V heads, then uptrain (chapter 03)
    minillm.train.distill       logit distillation in brief (chapter 06)
    minillm.train.pruning       magnitude and 2:4 pruning in brief (chapter 06)
    minillm.train.gguf_export   write and read llama.cpp's GGUF format (chapter 06)
    minillm.train.lora_finetune train a LoRA adapter with the base frozen, and the shipped one (chapter 08)

Nothing in the engine imports these: serving a model never trains one.
"""
