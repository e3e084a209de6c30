"""The torch-free text pipeline: tokenizer and chat templates, detokenizers, stop checker,
GGUF metadata and the default model's file. The gateway uses it without the engine."""
