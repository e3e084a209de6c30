"""Hugging Face checkpoint directories: `config.json` plus safetensors (single or sharded).

Reads shapes from the safetensors headers first, so a loader can validate every tensor
against the `ModelConfig` before it reads a single weight, then yields tensors one by one
(file by file) so peak memory stays near the model's own size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.config import Activation, Llama3RopeScaling, ModelConfig, MoEConfig, sliding_fields
from engine.models.families import SUPPORTED_ARCHITECTURES, unsupported_architecture_message
from text.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _int_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, Llama3RopeScaling | None]:
    # Newer configs nest theta and scaling in `rope_parameters`; older ones use
    # `rope_theta` and `rope_scaling` at the top level.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"{path}: unsupported rope scaling type {rope_type!r} "
                             f"(supported: default, llama3)")
    try:
        return theta, Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as exc:
        raise ModelLoadError(f"{path}: llama3 rope scaling lacks {exc.args[0]!r}") from None


def _activation(cfg: dict[str, Any], path: Path) -> Activation:
    # Gemma configs name it `hidden_activation` (older ones carry both names).
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    try:
        return Activation(name)
    except ValueError:
        raise ModelLoadError(f"{path}: unsupported hidden_act {name!r} (supported: "
                             f"{', '.join(a.value for a in Activation)})") from None


def _sliding(cfg: dict[str, Any], architecture: str, num_layers: int, max_positions: int,
             path: Path) -> dict[str, Any]:
    """The window and the layers it applies to, as transformers reads them: Mistral slides
    on every layer when `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`,
    on the layers from `max_window_layers` on; Gemma 2 on every even layer; Mixtral as
    Mistral; Qwen3-MoE on every layer with `use_sliding_window`; Qwen2-MoE on the even
    layers below `max_window_layers` with `use_sliding_window`. A `layer_types` list,
    where the config has one, names the sliding layers instead."""
    window = cfg.get("sliding_window")
    if architecture == "Gemma2ForCausalLM":
        default = [n % 2 == 0 for n in range(num_layers)]
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM") or (
            architecture == "Qwen3MoeForCausalLM" and cfg.get("use_sliding_window")):
        default = [True] * num_layers
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        default = [n >= first for n in range(num_layers)]
    elif architecture == "Qwen2MoeForCausalLM" and cfg.get("use_sliding_window"):
        below = int(cfg.get("max_window_layers", 28))
        default = [n % 2 == 0 and n < below for n in range(num_layers)]
    else:
        return {}
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention",
                                                                       "full_attention"}:
            raise ModelLoadError(f"{path}: layer_types {layer_types} is not one of "
                                 f"sliding_attention/full_attention per layer")
        default = [kind == "sliding_attention" for kind in layer_types]
    sliding = tuple(n for n, slides in enumerate(default) if slides)
    return sliding_fields(None if window is None else int(window), sliding, max_positions)


def _gemma2_fields(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 2's numerics: the query scalar and the soft-caps."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: bidirectional attention is unsupported")
    softcaps = [cfg.get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping")]
    return dict(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=None if softcaps[0] is None else float(softcaps[0]),
        final_logit_softcap=None if softcaps[1] is None else float(softcaps[1]))


def _moe(cfg: dict[str, Any], architecture: str, num_layers: int) -> MoEConfig | None:
    """The mixture-of-experts fields as transformers reads them. Mixtral: every layer, the
    experts `intermediate_size` wide, weights renormalised. Qwen3-MoE: layer n is sparse
    unless listed in `mlp_only_layers`, and only where (n + 1) % decoder_sparse_step == 0;
    experts `moe_intermediate_size` wide; renormalised where `norm_topk_prob`. Qwen2-MoE:
    as Qwen3-MoE, with a shared expert `shared_expert_intermediate_size` wide. Hub
    configs name the expert count `num_experts`, transformers 5 writes
    `num_local_experts`."""
    if architecture == "MixtralForCausalLM":
        return MoEConfig(num_experts=int(cfg["num_local_experts"]),
                         top_k=int(cfg.get("num_experts_per_tok", 2)),
                         intermediate_size=int(cfg["intermediate_size"]), renormalize=True,
                         layers=tuple(range(num_layers)))
    if architecture not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return None
    num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(n for n in range(num_layers)
                   if num_experts > 0 and n not in dense and (n + 1) % step == 0)
    if not layers:
        return None
    return MoEConfig(num_experts=num_experts, top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=int(cfg["moe_intermediate_size"]),
                     renormalize=bool(cfg.get("norm_topk_prob", False)), layers=layers,
                     shared_intermediate_size=int(cfg["shared_expert_intermediate_size"])
                     if architecture == "Qwen2MoeForCausalLM" else 0)


def read_config(directory: Path) -> ModelConfig:
    """The ModelConfig of an HF directory; ModelLoadError names the file and the problem."""
    path = directory / "config.json"
    cfg = _read_json(path)
    architectures = cfg.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: {unsupported_architecture_message(architecture)}")
    activation = _activation(cfg, path)
    is_gemma2 = architecture == "Gemma2ForCausalLM"
    if activation is not Activation.SILU and not is_gemma2:
        raise ModelLoadError(f"{path}: unsupported hidden_act {activation.value!r} "
                             f"on {architecture}")
    if architecture != "Qwen2ForCausalLM" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ModelLoadError(f"{path}: attention_bias/mlp_bias on {architecture} is unsupported")
    theta, scaling = _rope(cfg, path)
    eos = _int_ids(cfg.get("eos_token_id"))
    generation = directory / "generation_config.json"
    if generation.exists():
        extra = _int_ids(_read_json(generation).get("eos_token_id"))
        eos += tuple(e for e in extra if e not in eos)
    try:
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        family = _sliding(cfg, architecture, num_layers, max_positions, path)
        if is_gemma2:
            family.update(_gemma2_fields(cfg, path))
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_positions,
            # Gemma ties its head to the embedding unless the config says otherwise.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma2)),
            attention_bias=architecture == "Qwen2ForCausalLM" or (
                architecture == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            hidden_act=activation,
            moe=_moe(cfg, architecture, num_layers),
            **family,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


class HFCheckpoint:
    """The safetensors files of one directory and the tensors each holds."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / INDEX_FILE
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no 'weight_map' object")
            self.files = sorted({directory / f for f in weight_map.values()})
        else:
            self.files = sorted(directory.glob("*.safetensors"))
            if not self.files:
                raise ModelLoadError(f"{directory}: no *.safetensors files "
                                     f"(other weight formats are not supported)")
            weight_map = None
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in self.files:
            with self._open(file) as f:
                for name in f.keys():
                    self._file_of[name] = file
                    self._shapes[name] = tuple(f.get_slice(name).get_shape())
        if weight_map is not None:
            for name, file in weight_map.items():
                if self._file_of.get(name) != directory / file:
                    raise ModelLoadError(f"{directory / file}: lacks tensor {name!r} "
                                         f"listed in {index.name}")

    @staticmethod
    def _open(file: Path) -> Any:
        try:
            return safe_open(str(file), framework="pt")
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: file not found") from None
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors ({exc})") from None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name in the checkpoint and its shape (from the headers only)."""
        return dict(self._shapes)

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def iter_tensors(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) for the given names, one file at a time."""
        for file in self.files:
            with self._open(file) as f:
                for name in f.keys():
                    if name not in names:
                        continue
                    try:
                        yield name, f.get_tensor(name)
                    except (SafetensorError, OSError, RuntimeError) as exc:
                        raise ModelLoadError(f"{file}: cannot read tensor {name!r} "
                                             f"({exc})") from None
