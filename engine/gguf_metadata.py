"""A GGUF file's metadata header, read without touching tensor data (and without torch).

The header is parsed directly and the reader stops where the tensor table starts, so it
costs a fraction of a second even for large files: the gateway uses it to tokenize without
loading weights, and the tokenizer is built from the same record the weight loader uses.

    magic "GGUF" | version (u32, >= 2) | num_tensors (u64) | num_keys (u64) | keys...
    key: string (u64 length + UTF-8) | value type (u32) | value
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from engine.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
# GGUF value type -> struct format (little-endian); 8 = string and 9 = array are special.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTokenizerData:
    """The tokenizer as GGUF metadata stores it (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    padding_token_id: int | None
    add_bos_token: bool
    pre: str | None
    chat_template: str | None
    model: str | None = None  # tokenizer.ggml.model, e.g. "gpt2" (byte-level BPE) or "llama"


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of a GGUF (v2/v3) file; arrays become lists."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{path}: not a GGUF file")
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported")
            _num_tensors, num_keys = struct.unpack("<QQ", f.read(16))
            meta = {}
            for _ in range(num_keys):
                key = _read_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                meta[key] = _read_value(f, value_type, path)
            return meta
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata: {exc}") from exc


def tokenizer_data(meta: dict[str, Any], path: Path) -> GGUFTokenizerData:
    """The tokenizer record of a file's metadata (see `read_gguf_metadata`)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer.ggml.tokens")

    def optional_int(key: str) -> int | None:
        value = meta.get(key)
        return None if value is None else int(value)

    return GGUFTokenizerData(
        tokens=list(tokens),
        token_types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [])],
        merges=list(meta.get("tokenizer.ggml.merges", [])),
        bos_token_id=optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_int("tokenizer.ggml.eos_token_id"),
        unknown_token_id=optional_int("tokenizer.ggml.unknown_token_id"),
        padding_token_id=optional_int("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        pre=meta.get("tokenizer.ggml.pre"),
        chat_template=meta.get("tokenizer.chat_template"),
        model=meta.get("tokenizer.ggml.model"),
    )


def read_gguf_tokenizer_data(path: str | Path) -> GGUFTokenizerData:
    path = Path(path)
    return tokenizer_data(read_gguf_metadata(path), path)


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8")


def _read_value(f: BinaryIO, value_type: int, path: Path) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            return [v for (v,) in struct.iter_unpack(fmt, f.read(struct.calcsize(fmt) * count))]
        return [_read_value(f, item_type, path) for _ in range(count)]
    fmt = _SCALARS.get(value_type)
    if fmt is None:
        raise ModelLoadError(f"{path}: unknown GGUF value type {value_type}")
    (value,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
    return value
