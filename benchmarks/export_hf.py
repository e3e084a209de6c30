"""Write the default model as a Hugging Face folder (safetensors, config, tokenizer).

Benchmarks that compare pdserve with another server (benchmarks/vs_vllm_cpu.sh) give both
the same folder, so both load the same weights the same way. The weights are the GGUF's,
dequantised by transformers' own GGUF loader (nothing of pdserve's loader), then stored in
`--dtype`.

Usage: python benchmarks/export_hf.py OUT_DIR [--dtype bfloat16|float32|float16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(out_dir: Path, dtype_name: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from text.default_model import default_model_path

    path = default_model_path()
    print(f"export_hf: reading {path}", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = LlamaConfig(**load_gguf_checkpoint(str(path))["config"])
    model = LlamaForCausalLM(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                   model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise SystemExit(f"export_hf: the GGUF does not match the model: {result}")
    model.tie_weights()
    model = model.to(getattr(torch, dtype_name))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    print(f"export_hf: wrote {out_dir} ({dtype_name})", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"),
                        default="bfloat16", help="dtype the weights are stored in")
    args = parser.parse_args(argv)
    export(args.out_dir, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
