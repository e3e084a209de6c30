"""EngineConfig: the sizes of an engine's KV pool and batches (the model's shape is ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of the engine's KV pool and batches (model shape comes from ModelConfig)."""

    num_kv_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk_tokens: int | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # The KV pool's dtype; None: the model's `dtype`. torch.float8_e4m3fn: FP8 values with a
    # scale per token and KV head (engine/kv_quant.py), attention computed in `dtype`.
    kv_dtype: torch.dtype | None = None
    # Decode batch sizes captured as CUDA graphs; None: on CUDA the default set for
    # max_num_seqs (`decode_graph_sizes`), none on CPU (see engine/cuda_graphs.py).
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Steps with prefill chunks (up to max_num_batched_tokens, at most 4096 tokens) captured
    # as CUDA graphs too, where decode steps are (engine/mixed_graphs.py); False: eager, for
    # tests that hold the graphs against the eager path (workers always capture them).
    mixed_cuda_graphs: bool = True
    # On CUDA: size the KV pool to this fraction of device memory (engine/memory_plan.py)
    # instead of num_kv_blocks; None keeps num_kv_blocks.
    gpu_memory_fraction: float | None = None
    # A step's prompt tokens are what its decodes' tightest TPOT target leaves, by the
    # worker's step model (engine/step_budget.py); False: up to max_num_batched_tokens.
    hold_tpot: bool = False
    # Host memory for prefix blocks evicted from the KV pool (engine/host_kv_tier.py);
    # 0: off.
    kv_host_cache_bytes: int = 0
    # Prompts computed beside the decode steps, by a scheduler and runner of their own over
    # this engine's KV pool (engine/prefill_lane.py): on CUDA on this many SMs, the decode
    # steps on the rest (green contexts); on the CPU any positive value runs the lane's steps
    # in turn with the decode steps. 0: no lane, prompts are computed in the decode steps.
    prefill_lane_sms: int = 0
    # With a lane on CUDA: no SM partition; the lane's stream and the decode steps' share
    # every SM, the decode steps' stream at the higher priority (engine/lane_streams.py).
    prefill_lane_shared: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype}")
        if self.prefill_lane_sms < 0:
            raise ValueError(f"prefill_lane_sms must be >= 0, got {self.prefill_lane_sms}")
        if self.kv_host_cache_bytes < 0:
            raise ValueError(f"kv_host_cache_bytes must be >= 0, got {self.kv_host_cache_bytes}")
        if self.gpu_memory_fraction is not None and not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], "
                             f"got {self.gpu_memory_fraction}")
        if self.cuda_graph_batch_sizes is not None and any(
                b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be positive, "
                             f"got {self.cuda_graph_batch_sizes}")

    def decode_graph_sizes(self) -> tuple[int, ...] | None:
        """The decode batch sizes to capture: `cuda_graph_batch_sizes`, else on CUDA those
        for max_num_seqs (engine/cuda_graphs.py's `decode_batch_sizes`), else None (the
        runner's default: none off CUDA)."""
        if self.cuda_graph_batch_sizes is not None or not str(self.device).startswith("cuda"):
            return self.cuda_graph_batch_sizes
        from engine.cuda_graphs import decode_batch_sizes

        return decode_batch_sizes(self.max_num_seqs)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV pool's dtype."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @staticmethod
    def blocks_for_bytes(config: ModelConfig, kv_cache_bytes: int, block_size: int,
                         kv_dtype: torch.dtype) -> int:
        """How many blocks fit in `kv_cache_bytes` for this model (K and V, all layers) in
        a pool of `kv_dtype`."""
        from engine.memory_plan import kv_block_bytes

        return max(1, kv_cache_bytes // kv_block_bytes(config, block_size, kv_dtype))
