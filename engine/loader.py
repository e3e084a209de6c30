"""Builds a ready model from an HF directory, a `.gguf` file or "default".

    load_model(model) -> resolve the source -> read its ModelConfig
                      -> pick the family's class (engine/models/families.py)
                      -> validate every tensor's name and shape against the config
                      -> copy tensors one by one into the model (eval mode, on device)

Nothing is read into the model before the whole checkpoint has passed validation, so a bad
checkpoint fails fast with a `ModelLoadError` naming the file and the problem. The tokenizer
is built elsewhere from `LoadedModel.tokenizer_source`: the directory of an HF checkpoint,
or the `GGUFTokenizerData` read from a GGUF file's metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from text.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.models.decoder import DecoderForCausalLM
    from text.gguf_metadata import GGUFTokenizerData

# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_NUM_PROGRESS_REPORTS = 10


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    model: "DecoderForCausalLM"
    source: Path  # the resolved directory or .gguf file
    tokenizer_source: "Path | GGUFTokenizerData"  # HF directory, or GGUF tokenizer metadata


def load_model(model: str, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu",
               progress: Callable[[str], None] | None = None) -> LoadedModel:
    """Loads `model` (HF directory, `.gguf` path or "default"); raises ModelLoadError."""
    report = progress or (lambda message: None)
    path = _resolve(model)
    if path.is_dir():
        return _load_hf(path, dtype, device, report)
    return _load_gguf(path, dtype, device, report)


def read_model_config(model: str) -> ModelConfig:
    """The model's shape without loading weights (so a bad TP size fails before spawning
    anything); raises ModelLoadError."""
    path = _resolve(model)
    if path.is_dir():
        from engine.hf_reader import read_config

        return read_config(path)
    from engine.gguf_reader import GGUFCheckpoint

    return GGUFCheckpoint(path).config()


def _resolve(model: str) -> Path:
    """The directory or `.gguf` file `model` names; ModelLoadError if it is neither."""
    if model == "default":
        from text.default_model import default_model_path

        path = default_model_path()
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    return path


def _load_hf(directory: Path, dtype: torch.dtype, device: torch.device | str,
             report: Callable[[str], None]) -> LoadedModel:
    from engine.hf_reader import HFCheckpoint, read_config

    config = read_config(directory)
    report(f"reading {directory} ({config.architecture}, {config.num_layers} layers)")
    checkpoint = HFCheckpoint(directory)
    names = _validate(config, checkpoint.shapes, lambda n: str(checkpoint.file_of(n)),
                      str(directory))
    model = _fill(config, checkpoint.iter_tensors(names), len(names), dtype, device, report,
                  str(directory))
    return LoadedModel(config=config, model=model, source=directory, tokenizer_source=directory)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str,
               report: Callable[[str], None]) -> LoadedModel:
    from engine.gguf_reader import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.config()
    report(f"reading {path} ({config.num_layers} layers)")
    names = _validate(config, checkpoint.shapes, lambda n: str(path), str(path))
    model = _fill(config, checkpoint.iter_tensors(names, config), len(names), dtype, device,
                  report, str(path))
    return LoadedModel(config=config, model=model, source=path,
                       tokenizer_source=checkpoint.tokenizer_data())


def _validate(config: ModelConfig, shapes: dict[str, tuple[int, ...]],
              file_of: Callable[[str], str], source: str) -> set[str]:
    """The checkpoint names to load; raises unless they are exactly what the config needs."""
    from engine.models.families import model_class

    expected = model_class(config.architecture).expected_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: missing tensors {shown}")
    unexpected = sorted(
        n for n in set(shapes) - set(expected)
        if not n.endswith(_IGNORED_SUFFIXES)
        # Tied checkpoints sometimes store a copy of the embedding as the head.
        and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unexpected:
        raise ModelLoadError(f"{file_of(unexpected[0])}: unexpected tensors "
                             f"{', '.join(unexpected[:5])} for {config.architecture}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{file_of(name)}: tensor {name} has shape "
                                 f"{list(shapes[name])}, expected {list(shape)}")
    return set(expected)


def _fill(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], num_tensors: int,
          dtype: torch.dtype, device: torch.device | str,
          report: Callable[[str], None], source: str) -> "DecoderForCausalLM":
    from engine.models.families import model_class

    model = model_class(config.architecture)(config, dtype=dtype, device=device)
    params = dict(model.named_parameters())
    parameter_name = type(model).parameter_name
    every = max(1, num_tensors // _NUM_PROGRESS_REPORTS)
    num_loaded = 0
    with torch.no_grad():
        for name, tensor in tensors:
            params[parameter_name(name)].copy_(tensor)
            num_loaded += 1
            if num_loaded % every == 0 or num_loaded == num_tensors:
                report(f"loading weights: {num_loaded}/{num_tensors} tensors")
    if num_loaded != num_tensors:
        # Headers promised tensors the data did not deliver (e.g. an index naming a shard
        # whose tensor list changed between the two reads).
        raise ModelLoadError(f"{source}: loaded {num_loaded} of {num_tensors} tensors")
    return model.eval()
