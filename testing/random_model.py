"""Write a Hugging Face model directory with random weights in a real model's shape.

Speed does not depend on the weights' values, so GPU benchmarks of whole clusters run on
random weights in real shapes (no model download). The tokenizer files are exported from
the default model (SmolLM2's byte-level BPE and ChatML template), so prompts tokenize
normally; the vocabulary size is the tokenizer's.

    python -m testing.random_model OUT_DIR --shape llama3-1b          # on the GPU host
    python -m testing.random_model OUT_DIR --tokenizer-only            # export tokenizer files
    python -m testing.random_model OUT_DIR --shape llama3-8b --tokenizer-from DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

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


def write_weights(out: Path, shape: str, vocab_size: int, dtype_name: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    shape_config = SHAPES[shape]
    hidden, inter = shape_config.hidden_size, shape_config.intermediate_size
    layers, heads = shape_config.num_layers, shape_config.num_heads
    kv_heads, head_dim = shape_config.num_kv_heads, shape_config.head_dim
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": shape_config.rms_norm_eps, "rope_theta": shape_config.rope_theta,
        "max_position_embeddings": shape_config.max_position_embeddings,
        "tie_word_embeddings": False, "torch_dtype": dtype_name,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(vocab_size, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=dtype),
               "lm_head.weight": rand(vocab_size, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })
        print(f"layer {i + 1}/{layers}", file=sys.stderr, flush=True)
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
