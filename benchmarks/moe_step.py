"""Mixture-of-experts steps: the fused expert block against the floor, the torch grouping it
replaced, and transformers, on the same random weights in one process.

    fused    the runner's default path: the kernel path with the fused grouped GEMMs
             (engine/kernels/fused_moe.py), decode steps replayed from CUDA graphs
    grouped  the same runner, eager, every MoE block running its torch path (tokens sorted by
             expert, one matmul chain per expert with tokens, the slice bounds read on the
             host: what the kernel path ran before the fused block)
    transformers  eager forward (a DynamicCache holding the context for decode) with the
             same tensors (its fused [E, 2I, H] / [E, H, I] expert weights are ours)

Floors: benchmarks/step_floor.py's (decode: the bytes of the experts the batch picks;
prefill: the active parameters' FLOPs).

    python -m benchmarks.moe_step --shape qwen3-30b-a3b --batches 1,64,256 --context 512
    python -m benchmarks.moe_step --shape tiny-moe                  # CPU: plumbing only

Output: a markdown table on stdout; progress on stderr. Without CUDA it runs the tiny shape's
torch path and measures nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.engine_gpu_baseline import eager_decode_ms
from benchmarks.engine_gpu_model import BLOCK_SIZE, PREFILL_LEN, build_random_model, time_ms
from benchmarks.step_floor import StepRig, floor_rates, moe_blocks
from engine.config import ModelConfig


def log(message: str) -> None:
    print(f"[moe_step] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    case: str
    fused_ms: float
    floor_ms: float
    grouped_ms: float | None = None
    hf_ms: float | None = None


def to_transformers(model, config: ModelConfig):
    """A transformers Qwen3MoeForCausalLM holding our tensors (no copy): built on the meta
    device, our parameters assigned, its rotary table made on ours."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    moe = config.moe
    assert moe is not None
    hf_config = Qwen3MoeConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.intermediate_size, norm_topk_prob=moe.renormalize,
        decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=config.rope_theta))
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hf_config).to(dtype)
    state = {name: t for name, t in model.state_dict().items() if ".experts." not in name}
    for n, block in enumerate(model.model.layers):
        mlp = block.mlp
        mlp.fuse_experts()  # (done already where the kernel path ran)
        state[f"model.layers.{n}.mlp.experts.gate_up_proj"] = mlp.w13
        state[f"model.layers.{n}.mlp.experts.down_proj"] = mlp.w2
    hf.load_state_dict(state, assign=True, strict=True)
    hf.model.rotary_emb = Qwen3MoeRotaryEmbedding(hf_config).to(device)
    return hf.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None,
                        help="a testing/shapes.py MoE shape (default: qwen3-30b-a3b on CUDA, "
                             "tiny-moe elsewhere)")
    parser.add_argument("--batches", default="1,64,256", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512,
                        help="tokens of context each decode row attends to")
    parser.add_argument("--kv-gib", type=float, default=4.0,
                        help="KV pool size; rows share its blocks round-robin beyond it")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip the transformers baseline")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    from engine.model_runner import ModelRunner
    from testing.shapes import SHAPES

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    shape = args.shape or ("qwen3-30b-a3b" if on_cuda else "tiny-moe")
    config = SHAPES[shape]
    if config.moe is None:
        parser.error(f"--shape {shape} has no mixture-of-experts layers")
    batches = [int(b) for b in args.batches.split(",")]
    copy_rate, matmul_rate = floor_rates(device)
    log(f"floors: copy {copy_rate / 1e9:.0f} GB/s, "
        f"bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s")
    start = time.perf_counter()
    model = build_random_model(config, args.seed, device, dtype)
    log(f"built {shape} in {time.perf_counter() - start:.1f} s")
    rig = StepRig.build(model, config, batches, args.context, args.kv_gib, device, dtype)
    fused, prefill = rig.runner, rig.prefill
    log(f"runner ready (kernel path {fused.use_kernels}), pool {rig.kv.layout.num_blocks} "
        "blocks")
    rows = [Row(case, ms, floor) for case, ms, floor in
            rig.measure(copy_rate, matmul_rate, device, lambda line: log(f"fused {line}"))]
    # The torch grouping, eager, on the same runner kind: each block's forward.
    grouped = ModelRunner(model, rig.kv, BLOCK_SIZE, cuda_graph_batch_sizes=(),
                          mixed_graph_tokens=0)
    for block in moe_blocks(model):
        block.forward_kernels = lambda x, _workspace, block=block: block.forward(x)
    steps = [*rig.decodes.values(), prefill]
    for row, schedule in zip(rows, steps):
        row.grouped_ms = time_ms(lambda: grouped.execute(schedule), device, warmup=2, reps=5)
        log(f"grouped {row.case}: {row.grouped_ms:.2f} ms")
    for block in moe_blocks(model):
        del block.forward_kernels
    del grouped
    if not args.no_transformers:
        try:
            hf = to_transformers(model, config)
            # The baseline computes the same model: the prompt's next-token logits agree.
            ours = fused.execute(prefill)[0].float()
            with torch.no_grad():
                tokens = torch.tensor([prefill.chunks[0].token_ids], device=device)
                theirs = hf(input_ids=tokens, use_cache=False, logits_to_keep=1).logits[0, -1]
            error = float((ours - theirs.float()).abs().max() / theirs.float().abs().max())
            log(f"logits vs transformers: max error {error:.3g} of the largest logit")
            for row, batch in zip(rows, batches):
                row.hf_ms = eager_decode_ms(hf, config, batch, args.context, device, reps=6)
                log(f"transformers {row.case}: {row.hf_ms:.2f} ms")
            ids = torch.randint(0, config.vocab_size, (1, PREFILL_LEN), device=device)
            with torch.no_grad():
                rows[-1].hf_ms = time_ms(lambda: hf(input_ids=ids, use_cache=False,
                                                    logits_to_keep=1), device, warmup=1, reps=3)
            log(f"transformers prefill: {rows[-1].hf_ms:.2f} ms")
        except Exception as exc:  # noqa: BLE001 - the baseline is optional; say why it is missing
            log(f"transformers baseline skipped: {type(exc).__name__}: {exc}")
    name = torch.cuda.get_device_name() if on_cuda else "CPU (plumbing only)"
    print(f"{shape} on {name}, {str(dtype).removeprefix('torch.')} random weights\n")
    print("| step | fused ms | floor ms | % of floor | grouped (torch) ms | fused vs grouped "
          "| transformers ms | vs transformers |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        grouped_x = f"{row.grouped_ms / row.fused_ms:.2f}x" if row.grouped_ms else "-"
        hf_x = f"{row.hf_ms / row.fused_ms:.1f}x" if row.hf_ms else "-"
        print(f"| {row.case} | {row.fused_ms:.2f} | {row.floor_ms:.2f} | "
              f"{100 * row.floor_ms / row.fused_ms:.0f}% | "
              f"{row.grouped_ms:.2f} | {grouped_x} | "
              f"{'-' if row.hf_ms is None else f'{row.hf_ms:.2f}'} | {hf_x} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
