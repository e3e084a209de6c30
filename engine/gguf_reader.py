"""GGUF files (llama.cpp format): config from metadata, dequantized tensors, tokenizer data.

Tensors are renamed to the Hugging Face names the model uses and dequantized to float32
with `gguf.quants.dequantize` (any type it knows: F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants).

Architectures: `llama` (Llama, Mistral, SmolLM as llama.cpp converts them), `qwen2` (q/k/v
biases `blk.N.attn_q.bias` ...), `qwen3` (per-head q/k norms `blk.N.attn_q_norm.weight` /
`attn_k_norm.weight`), `qwen3moe` (Qwen3's norms; a router `blk.N.ffn_gate_inp.weight` and
each projection of all experts in one 3D tensor `blk.N.ffn_{gate,up,down}_exps.weight`,
[experts, out, in] in torch order, which the reader splits into the per-expert tensors of
HF checkpoints; every layer sparse, the picked weights renormalised, as llama.cpp runs it:
the format stores no `norm_topk_prob`) and `gemma2` (four norms a layer, `ffn_norm` being
the one before the MLP, each stored as 1 + weight). Only llama.cpp's `llama` converter
reorders Q/K rows. Other mixture-of-experts files (`llama` with an `expert_count`, as
Mixtral converts) are refused.
Metadata keys are prefixed by the architecture (`qwen3.block_count`).

llama.cpp's converter reorders the rows of the Q and K projections of `llama` models so that
its RoPE can rotate adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves
(x0, x_{d/2}), ... used here. Per head of size d, the converter maps

    HF row  j * (d/2) + i   ->   GGUF row  2 * i + j        (i < d/2, j in {0, 1})

i.e. `w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`. `unpermute_rows` applies the inverse,
`w.reshape(n_head, d/2, 2, in).swapaxes(1, 2)`, giving back the HF rows exactly.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import Activation, ModelConfig, MoEConfig, sliding_fields
from text.errors import ModelLoadError
from text.gguf_metadata import GGUFTensorInfo, GGUFTokenizerData, read_gguf_header, tokenizer_data

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# One GGUF tensor holding every expert's projection -> the HF name of expert 0's.
_EXPERT_NAMES = {"ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
                 "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
                 "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight"}
# Gemma 2 names its four norms apart; its `ffn_norm` is the norm before the MLP.
_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# GGUF `general.architecture` -> the HF architecture it holds.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM"}
# Architectures whose converter permutes Q/K rows (see the module docstring).
_PERMUTED_QK = {"llama"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor name in a file of architecture `arch`; None
    when the model has no such tensor."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    layer_names = _GEMMA2_LAYER_NAMES if arch == "gemma2" else _LAYER_NAMES
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    return None


def expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The HF names, expert by expert, of a GGUF tensor holding every expert's projection;
    None for any other tensor."""
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        return None
    pattern = f"model.layers.{match.group(1)}.{_EXPERT_NAMES[match.group(2)]}"
    return [pattern.format(e) for e in range(num_experts)]


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row order for RoPE (see the module docstring)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class GGUFCheckpoint:
    """One GGUF file of a `llama`, `qwen2`, `qwen3`, `qwen3moe` or `gemma2` model: its header
    parsed here (text/gguf_metadata.py), its tensor data memory-mapped and read one tensor
    at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found")
        header = read_gguf_header(path)
        self._meta = header.meta
        arch = self._get("general.architecture")
        if arch not in _ARCHITECTURES:
            raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                                 f"(supported: {', '.join(_ARCHITECTURES)})")
        self.arch: str = arch
        num_experts = self._get(f"{arch}.expert_count", 0)
        if num_experts and arch != "qwen3moe":
            raise ModelLoadError(f"{path}: mixture-of-experts GGUF files are unsupported "
                                 f"({arch!r} with {num_experts} experts, e.g. Mixtral); "
                                 f"load the Hugging Face directory instead")
        self._tensors = header.tensors
        if "rope_freqs.weight" in self._tensors:
            raise ModelLoadError(f"{path}: per-frequency RoPE factors (rope_freqs.weight) "
                                 f"are unsupported")

    def _get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        value = self._meta.get(key)
        if value is None:
            if required:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return value

    def config(self) -> ModelConfig:
        a = self.arch
        hidden = int(self._get(f"{a}.embedding_length", required=True))
        num_heads = int(self._get(f"{a}.attention.head_count", required=True))
        scaling = self._get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ModelLoadError(f"{self.path}: unsupported rope scaling type {scaling!r}")
        tokens = self._meta.get("tokenizer.ggml.tokens")
        vocab = self._get(f"{a}.vocab_size", len(tokens) if tokens is not None else None)
        if vocab is None:
            raise ModelLoadError(f"{self.path}: neither {a}.vocab_size nor a token list")
        bos, eos = self._get("tokenizer.ggml.bos_token_id"), self._get("tokenizer.ggml.eos_token_id")
        num_layers = int(self._get(f"{a}.block_count", required=True))
        head_dim = int(self._get(f"{a}.attention.key_length", hidden // num_heads))
        context = int(self._get(f"{a}.context_length", 2048))
        family: dict[str, Any] = {}
        if a == "gemma2":
            family = self._gemma2_fields(num_layers, hidden // num_heads, head_dim, context)
        elif a == "qwen3moe":
            family = dict(moe=MoEConfig(
                num_experts=int(self._get(f"{a}.expert_count", required=True)),
                top_k=int(self._get(f"{a}.expert_used_count", required=True)),
                intermediate_size=int(self._get(f"{a}.expert_feed_forward_length",
                                                required=True)),
                renormalize=True, layers=tuple(range(num_layers))))
        try:
            return ModelConfig(
                architecture=_ARCHITECTURES[a],
                vocab_size=int(vocab),
                hidden_size=hidden,
                # qwen3moe files may name no dense width: none of their layers is dense.
                intermediate_size=int(
                    self._get(f"{a}.feed_forward_length", required=a != "qwen3moe")
                    or self._get(f"{a}.expert_feed_forward_length", required=True)),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(self._get(f"{a}.attention.head_count_kv", num_heads)),
                head_dim=head_dim,
                rms_norm_eps=float(self._get(f"{a}.attention.layer_norm_rms_epsilon",
                                             required=True)),
                rope_theta=float(self._get(f"{a}.rope.freq_base", 10000.0)),
                max_position_embeddings=context,
                tie_word_embeddings="output.weight" not in self._tensors,
                attention_bias=a == "qwen2",
                bos_token_id=None if bos is None else int(bos),
                eos_token_ids=() if eos is None else (int(eos),),
                **family,
            )
        except ValueError as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from None

    def _gemma2_fields(self, num_layers: int, hidden_per_head: int, head_dim: int,
                       context: int) -> dict[str, Any]:
        """Gemma 2's numerics from llama.cpp's keys. The format has no query scalar:
        llama.cpp takes head_dim, except for the 27B model (46 layers), whose scalar is
        hidden / heads; so does this reader. Every even layer slides, as in transformers."""
        caps = [self._get(f"gemma2.{key}") for key in ("attn_logit_softcapping",
                                                       "final_logit_softcapping")]
        window = self._get("gemma2.attention.sliding_window")
        return dict(
            hidden_act=Activation.GELU_TANH,
            query_pre_attn_scalar=float(hidden_per_head if num_layers == 46 else head_dim),
            attn_logit_softcap=None if caps[0] is None else float(caps[0]),
            final_logit_softcap=None if caps[1] is None else float(caps[1]),
            **sliding_fields(None if window is None else int(window),
                             tuple(range(0, num_layers, 2)), context))

    def tokenizer_data(self) -> GGUFTokenizerData:
        return tokenizer_data(self._meta, self.path)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> torch shape of every tensor; GGUF tensors without one keep their name."""
        # GGUF lists dimensions innermost first; torch lists them outermost first.
        shapes: dict[str, tuple[int, ...]] = {}
        for name, t in self._tensors.items():
            shape = tuple(reversed(t.dims))
            experts = expert_names(name, shape[0]) if self.arch == "qwen3moe" else None
            if experts is None:
                shapes[hf_name(name, self.arch) or name] = shape
            else:
                shapes.update((expert, shape[1:]) for expert in experts)
        return shapes

    def iter_tensors(self, names: set[str], config: ModelConfig
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF name, float32 tensor) for the requested names, Q/K rows in HF order."""
        from gguf.constants import GGMLQuantizationType  # heavy import: only to load weights
        from gguf.quants import dequantize

        with open(self.path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        permuted = self.arch in _PERMUTED_QK
        for gguf_name, t in self._tensors.items():
            shape = tuple(reversed(t.dims))
            experts = expert_names(gguf_name, shape[0]) if self.arch == "qwen3moe" else None
            name = hf_name(gguf_name, self.arch)
            if name not in names and not (experts and names.intersection(experts)):
                continue
            try:
                qtype = GGMLQuantizationType(t.ggml_type)
                weight = dequantize(_raw(data, t, qtype, self.path), qtype).reshape(shape)
            except (NotImplementedError, ValueError) as exc:
                raise ModelLoadError(f"{self.path}: cannot dequantize {gguf_name} "
                                     f"(type {t.ggml_type}): {exc}") from None
            if experts is not None:
                for expert, expert_weight in zip(experts, weight):
                    if expert in names:
                        yield expert, torch.from_numpy(np.array(expert_weight, dtype=np.float32))
                continue
            assert name is not None  # in `names`
            if permuted and name.endswith("self_attn.q_proj.weight"):
                weight = unpermute_rows(weight, config.num_heads)
            elif permuted and name.endswith("self_attn.k_proj.weight"):
                weight = unpermute_rows(weight, config.num_kv_heads)
            elif self.arch == "gemma2" and name.endswith("norm.weight"):
                weight = weight - np.float32(1.0)  # stored as 1 + weight
            # F32 tensors come back as read-only views of the memory-mapped file.
            if not weight.flags.writeable:
                weight = weight.copy()
            yield name, torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))


def _raw(data: mmap.mmap, tensor: GGUFTensorInfo, qtype: Any, path: Path) -> np.ndarray:
    """A tensor's bytes as `gguf.quants.dequantize` takes them: F32 and F16 as their numbers,
    any other type as rows of bytes (the innermost dimension in whole blocks)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    inner = tensor.dims[0] if tensor.dims else 1
    if inner % block:
        raise ValueError(f"{inner} elements are not whole blocks of {block}")
    outer = tuple(reversed(tensor.dims[1:]))
    row_bytes = inner // block * block_bytes
    num_bytes = row_bytes * math.prod(outer)
    if tensor.offset + num_bytes > len(data):
        raise ModelLoadError(f"{path}: tensor data runs past the end of the file (truncated?)")
    raw = np.frombuffer(data, dtype=np.uint8, count=num_bytes, offset=tensor.offset)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(*outer, inner)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(*outer, inner)
    return raw.reshape(*outer, row_bytes)
