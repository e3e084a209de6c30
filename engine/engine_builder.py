"""Builds an engine from a model name: loads the weights, sizes the KV pool, picks the runner.

    build_engine("default" | a directory | a .gguf file, EngineConfig) -> LLMEngine

The pool is sized by `gpu_memory_fraction` on CUDA (engine/memory_plan.py), else by
`kv_cache_bytes` when given, else `EngineConfig.num_kv_blocks`. Tensor-parallel engines are
built by engine/tensor_parallel_group.py instead (a shard's pool, a runner that drives followers).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.llm_engine import EngineConfig, LLMEngine
from text.tokenizer import Tokenizer


def load_tokenizer(tokenizer_source: object) -> Tokenizer:
    """The tokenizer for a `LoadedModel.tokenizer_source` (HF directory or GGUF metadata)."""
    from pathlib import Path

    if isinstance(tokenizer_source, Path):
        return Tokenizer.from_hf_dir(tokenizer_source)
    return Tokenizer.from_gguf_fields(tokenizer_source)


def build_engine(model: str, config: EngineConfig,
                 progress: Callable[[str], None] | None = None,
                 kv_cache_bytes: int | None = None) -> LLMEngine:
    """Load `model` ("default", a directory or a .gguf file) and build an engine around it.
    With `kv_cache_bytes`, the KV pool is sized from it instead of `config.num_kv_blocks`."""
    import dataclasses

    from engine.loader import load_model

    loaded = load_model(model, dtype=config.dtype, device=config.device, progress=progress)
    if config.gpu_memory_fraction is not None and str(config.device).startswith("cuda"):
        from engine.memory_plan import plan_for_model
        from engine.mixed_graphs import logits_rows

        graph_sizes = config.decode_graph_sizes() or ()
        # A prefill lane's step runs beside the engine's own: two steps' activations at once.
        step_tokens = config.max_num_batched_tokens * (2 if config.prefill_lane_sms else 1)
        plan = plan_for_model(loaded.model, config.block_size, config.kv_cache_dtype,
                              config.gpu_memory_fraction, step_tokens,
                              max(graph_sizes, default=0),
                              logits_rows(config.max_num_batched_tokens,
                                          max(graph_sizes, default=0))
                              if config.mixed_cuda_graphs else 0)
        if progress is not None:
            progress(plan.report())
        config = dataclasses.replace(config, num_kv_blocks=plan.num_kv_blocks)
    elif kv_cache_bytes is not None:
        config = dataclasses.replace(config, num_kv_blocks=EngineConfig.blocks_for_bytes(
            loaded.config, kv_cache_bytes, config.block_size, config.kv_cache_dtype))
    return LLMEngine.for_model(loaded.model, loaded.config,
                              load_tokenizer(loaded.tokenizer_source), config)
