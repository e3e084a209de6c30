"""Write a Hugging Face model directory with random weights in a real model's shape.

Speed does not depend on the weights' values, so GPU benchmarks of whole clusters run on
random weights in real shapes (no model download). The tokenizer files are exported from
the default model (SmolLM2's byte-level BPE and ChatML template), so prompts tokenize
normally; the vocabulary size is the tokenizer's.

    python -m testing.random_model OUT_DIR --shape llama3-1b          # on the GPU host
    python -m testing.random_model OUT_DIR --tokenizer-only            # export tokenizer files
    python -m testing.random_model OUT_DIR --shape llama3-8b --tokenizer-from DIR
    python -m testing.random_model OUT_DIR --shape qwen3-30b-a3b      # 61 GB on disk

Shapes: testing/shapes.py (Llama, Qwen3 and Qwen3-MoE families).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from engine.config import ModelConfig
from testing.shapes import SHAPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_tokenizer(out: Path) -> int:
    """Writes tokenizer.json + tokenizer_config.json of the default model; returns vocab size."""
    from text.default_model import default_model_path
    from text.gguf_metadata import read_gguf_tokenizer_data
    from text.tokenizer import Tokenizer

    data = read_gguf_tokenizer_data(default_model_path())
    tokenizer = Tokenizer.from_gguf_fields(data)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    tokens = data.tokens
    config = {
        "chat_template": data.chat_template,
        "bos_token": tokens[data.bos_token_id] if data.bos_token_id is not None else None,
        "eos_token": tokens[data.eos_token_id] if data.eos_token_id is not None else None,
        "add_bos_token": data.add_bos_token,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tokenizer.vocab_size


def hf_config(config: ModelConfig, dtype_name: str) -> dict[str, object]:
    """The config.json transformers (and engine/hf_reader.py) read for `config`: Llama,
    Qwen3 and Qwen3-MoE shapes."""
    model_types = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                   "Qwen3MoeForCausalLM": "qwen3_moe"}
    if config.architecture not in model_types:
        raise ValueError(f"no random checkpoints of {config.architecture}")
    out: dict[str, object] = {
        "architectures": [config.architecture], "model_type": model_types[config.architecture],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": dtype_name,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if (scaling := config.rope_scaling) is not None:
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if (moe := config.moe) is not None:
        dense = [n for n in range(config.num_layers) if n not in moe.layers]
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.intermediate_size,
                   norm_topk_prob=moe.renormalize, decoder_sparse_step=1,
                   mlp_only_layers=dense)
    return out


def write_weights(out: Path, shape: str, vocab_size: int, dtype_name: str, seed: int) -> None:
    """config.json and model.safetensors of the shape (its vocabulary: `vocab_size`): every
    tensor the model class expects (engine/models/), norms at one, the rest N(0, 0.02)."""
    import torch
    from safetensors.torch import save_file

    from engine.models.families import model_class

    config = dataclasses.replace(SHAPES[shape], vocab_size=vocab_size)
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype_name), indent=1))
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = model_class(config.architecture).expected_shapes(config)
    for i, (name, size) in enumerate(shapes.items()):
        if "norm" in name.rsplit(".", 2)[-2]:
            tensors[name] = torch.ones(size, dtype=dtype)
        else:
            tensors[name] = (torch.randn(size, generator=generator) * 0.02).to(dtype)
        if (i + 1) % 100 == 0 or i + 1 == len(shapes):
            print(f"tensor {i + 1}/{len(shapes)}", file=sys.stderr, flush=True)
    save_file(tensors, str(out / "model.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="model shape (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the weights' dtype (default bfloat16)")
    parser.add_argument("--seed", type=int, default=0, help="random weights' seed (default 0)")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="copy tokenizer files from this directory instead of exporting "
                             "them from the default model")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="only export the default model's tokenizer files into OUT")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            shutil.copy(args.tokenizer_from / name, args.out / name)
        vocab_size = len(json.loads((args.out / "tokenizer.json").read_text())["model"]["vocab"])
    else:
        vocab_size = export_tokenizer(args.out)
    if not args.tokenizer_only:
        write_weights(args.out, args.shape, vocab_size, args.dtype, args.seed)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
