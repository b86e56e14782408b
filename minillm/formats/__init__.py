"""File formats a model arrives in, beside Hugging Face's folders (`minillm.checkpoints`): `gguf_reader`, llama.cpp's
GGUF (chapters 00 and 06)."""
