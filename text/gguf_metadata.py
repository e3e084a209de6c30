"""A GGUF file's header: its metadata, and where each tensor lies, read without touching
tensor data (and without torch).

The header is parsed directly, so it costs a fraction of a second even for large files
(gguf's own GGUFReader builds a numpy view per token of the vocabulary: about ten seconds
for a 49k-token model). The gateway reads the metadata alone to tokenize without loading
weights (`read_gguf_metadata` stops where the tensor table starts); the weight loader
(engine/gguf_reader.py) reads the tensor table too (`read_gguf_header`).

    magic "GGUF" | version (u32, >= 2) | num_tensors (u64) | num_keys (u64) | keys...
    key: string (u64 length + UTF-8) | value type (u32) | value
    tensor: name (string) | num_dims (u32) | dims (u64 each, innermost first) |
            ggml type (u32) | offset (u64, from the data section's start)
    data section: at the first multiple of general.alignment (32) after the table
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from text.errors import ModelLoadError

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


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    ggml_type: int
    offset: int  # bytes from the start of the file


# A GGUF metadata value: a number, a bool, a string or an array of them (arrays become lists).
GGUFMetadata = dict[str, object]


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    meta: GGUFMetadata
    tensors: dict[str, GGUFTensorInfo]  # in file order


def read_gguf_metadata(path: Path) -> GGUFMetadata:
    """Every metadata key of a GGUF (v2/v3) file; arrays become lists."""
    return _read(path, with_tensors=False).meta


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and the tensor table (tensor offsets made absolute)."""
    return _read(path, with_tensors=True)


def _read(path: Path, with_tensors: bool) -> GGUFHeader:
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{path}: not a GGUF file")
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported")
            num_tensors, num_keys = struct.unpack("<QQ", f.read(16))
            meta = {}
            for _ in range(num_keys):
                key = _read_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                meta[key] = _read_value(f, value_type, path)
            if not with_tensors:
                return GGUFHeader(meta, {})
            table = []
            for _ in range(num_tensors):
                name = _read_string(f)
                (num_dims,) = struct.unpack("<I", f.read(4))
                dims = struct.unpack(f"<{num_dims}Q", f.read(8 * num_dims))
                ggml_type, offset = struct.unpack("<IQ", f.read(12))
                table.append((name, dims, ggml_type, offset))
            alignment = int(meta.get("general.alignment", 32))
            start = -(-f.tell() // alignment) * alignment
            tensors = {name: GGUFTensorInfo(tuple(dims), ggml_type, start + offset)
                       for name, dims, ggml_type, offset in table}
            return GGUFHeader(meta, tensors)
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or damaged "
                             f"header: {exc})") from exc


def meta_int(meta: GGUFMetadata, key: str, path: Path) -> int | None:
    """An integer field (None when absent); a field of another type is a damaged file."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ModelLoadError(f"{path}: GGUF field {key} is not a number")
    return int(value)


def meta_str(meta: GGUFMetadata, key: str, path: Path) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{path}: GGUF field {key} is not a string")
    return value


def meta_list(meta: GGUFMetadata, key: str, path: Path) -> list[object]:
    """An array field (empty when absent)."""
    value = meta.get(key, [])
    if not isinstance(value, list):
        raise ModelLoadError(f"{path}: GGUF field {key} is not an array")
    return value


def tokenizer_data(meta: GGUFMetadata, path: Path) -> GGUFTokenizerData:
    """The tokenizer record of a file's metadata (see `read_gguf_metadata`)."""
    tokens = [str(t) for t in meta_list(meta, "tokenizer.ggml.tokens", path)]
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    raw_types = meta_list(meta, "tokenizer.ggml.token_type", path)
    token_types = [t for t in raw_types if isinstance(t, int)]
    if len(token_types) != len(raw_types):
        raise ModelLoadError(f"{path}: GGUF field tokenizer.ggml.token_type is not integers")
    return GGUFTokenizerData(
        tokens=tokens,
        token_types=token_types,
        merges=[str(m) for m in meta_list(meta, "tokenizer.ggml.merges", path)],
        bos_token_id=meta_int(meta, "tokenizer.ggml.bos_token_id", path),
        eos_token_id=meta_int(meta, "tokenizer.ggml.eos_token_id", path),
        unknown_token_id=meta_int(meta, "tokenizer.ggml.unknown_token_id", path),
        padding_token_id=meta_int(meta, "tokenizer.ggml.padding_token_id", path),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        pre=meta_str(meta, "tokenizer.ggml.pre", path),
        chat_template=meta_str(meta, "tokenizer.chat_template", path),
        model=meta_str(meta, "tokenizer.ggml.model", path),
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
    scalar = _SCALARS.get(value_type)
    if scalar is None:
        raise ModelLoadError(f"{path}: unknown GGUF value type {value_type}")
    (value,) = struct.unpack(scalar, f.read(struct.calcsize(scalar)))
    return value
