"""A model's decode and prefill steps against their floors, in one process: what
benchmarks/moe_step.py and benchmarks/family_step.py share.

Floors, from rates measured on this device now (benchmarks/engine_gpu_kernels.py):
    decode   bytes the step must read / copy rate: every weight but the embedding table and
             the experts no token of the batch picked (counted from the step's own routing),
             plus the batch's KV
    prefill  matmul FLOPs of the active parameters (attention, router, top_k experts per
             token; the vocabulary head for the last token) and attention / matmul rate

    floor_rates(device)     (copy bytes/s, matmul FLOP/s): measured on CUDA, nominal elsewhere
    StepRig.build(...)      a model's KV pool and runner (decode graphs on CUDA) and the steps
    rig.measure(...)        (case, ms, floor ms) per decode batch, then the 1 x 2048 prefill
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.engine_gpu_model import (BLOCK_SIZE, PREFILL_LEN, decode_schedule, kv_bytes,
                                         prefill_schedule, time_ms)
from engine.config import ModelConfig

Step = tuple[str, float, float]  # case, ms, floor ms


def moe_blocks(model) -> list[Any]:
    from engine.models.moe import MoEBlock

    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def expert_params(block) -> int:
    expert = block.experts[0]
    return sum(getattr(expert, n).weight.numel() for n in ("gate_proj", "up_proj", "down_proj"))


def decode_read_bytes(model, config: ModelConfig, batch: int, context: int, touched: list[int],
                      element_size: int) -> int:
    """What a decode step must read: weights except the embedding and unpicked experts, and KV."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    unpicked = sum((b.num_experts - t) * expert_params(b)
                   for b, t in zip(moe_blocks(model), touched))
    return (total - (embed.numel() + unpicked) * embed.element_size()
            + kv_bytes(config, batch * context, element_size))


def prefill_active_flops(model, config: ModelConfig, length: int) -> float:
    """Matmul FLOPs of a 1 x length prefill through the active parameters."""
    embed = model.model.embed_tokens.weight.numel()
    head = config.vocab_size * config.hidden_size
    unpicked = sum((b.num_experts - b.top_k) * expert_params(b) for b in moe_blocks(model))
    per_token = sum(p.numel() for p in model.parameters()) - embed - head - unpicked
    pairs = length * (length + 1) / 2
    attention = 4 * pairs * config.num_heads * config.head_dim * config.num_layers
    return 2 * per_token * length + 2 * head + attention


def touched_experts(model, step: Callable[[], object]) -> list[int]:
    """Per MoE block, the experts one run of `step` routes at least one token to."""
    blocks = moe_blocks(model)
    for block in blocks:
        block.take_expert_tokens()
    step()
    return [sum(1 for c in block.take_expert_tokens() if c) for block in blocks]


def floor_rates(device: torch.device) -> tuple[float, float]:
    """(copy bytes/s, matmul FLOP/s): measured now on CUDA; nominal elsewhere (a CPU run
    checks the plumbing, it measures nothing)."""
    if device.type != "cuda":
        return 1e11, 1e12
    from benchmarks.engine_gpu_kernels import measure_floors

    floors = measure_floors()
    return floors.copy_bytes_per_s, floors.matmul_flop_per_s


@dataclass
class StepRig:
    """A model with its KV pool and runner, and the steps timed on them."""

    model: Any
    config: ModelConfig
    kv: Any  # engine.kv_storage.KVStorage
    runner: Any  # engine.model_runner.ModelRunner
    context: int
    decodes: dict[int, Any]  # batch -> its decode schedule
    prefill: Any

    @classmethod
    def build(cls, model, config: ModelConfig, batches: list[int], context: int,
              kv_gib: float, device: torch.device, dtype: torch.dtype) -> "StepRig":
        """A pool of up to `kv_gib` (rows share its blocks round-robin beyond it) and the
        runner's default path, decode graphs at `batches` on CUDA."""
        from engine.kv_storage import KVStorage
        from engine.memory_plan import kv_block_bytes
        from engine.model_runner import ModelRunner

        blocks_per_seq = -(-context // BLOCK_SIZE)
        pool = max(blocks_per_seq, -(-PREFILL_LEN // BLOCK_SIZE),
                   min(max(batches) * blocks_per_seq,
                       int(kv_gib * 2**30 // kv_block_bytes(config, BLOCK_SIZE, dtype))))
        kv = KVStorage.for_model(config, pool, BLOCK_SIZE, dtype, device)
        runner = ModelRunner(model, kv, BLOCK_SIZE, mixed_graph_tokens=0,
                             cuda_graph_batch_sizes=tuple(batches) if device.type == "cuda"
                             else ())
        return cls(model, config, kv, runner, context,
                   {b: decode_schedule(b, context, blocks_per_seq, pool) for b in batches},
                   prefill_schedule(1, PREFILL_LEN, config.vocab_size))

    def measure(self, copy_rate: float, matmul_rate: float, device: torch.device,
                log: Callable[[str], None]) -> list[Step]:
        element = self.kv.kv.element_size()
        steps = []
        for batch, schedule in self.decodes.items():
            ms = time_ms(lambda: self.runner.execute(schedule), device, warmup=3, reps=20)
            touched = touched_experts(self.model, lambda: self.runner.execute(schedule))
            floor = 1000 * decode_read_bytes(self.model, self.config, batch, self.context,
                                             touched, element) / copy_rate
            steps.append((f"decode batch {batch} ctx {self.context}", ms, floor))
            picked = f", experts picked {min(touched)}-{max(touched)}" if touched else ""
            log(f"decode b{batch}: {ms:.2f} ms, floor {floor:.2f} ms{picked}")
        ms = time_ms(lambda: self.runner.execute(self.prefill), device, warmup=2, reps=5)
        steps.append((f"prefill 1x{PREFILL_LEN}", ms, 1000 * prefill_active_flops(
            self.model, self.config, PREFILL_LEN) / matmul_rate))
        log(f"prefill: {ms:.2f} ms")
        return steps
