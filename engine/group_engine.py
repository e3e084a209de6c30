"""Rank 0's engine over a tensor- or expert-parallel group on this host: the followers
spawned, rank 0's shard loaded, its KV pool sized per rank, and a runner that drives the
followers (engine/tensor_parallel_group.py). The group ends with the context.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.expert_parallel import REBALANCE_INTERVAL_STEPS
from engine.kv_storage import KVStorage
from engine.tensor_parallel_group import (DrivingRunner, Followers, connect, load_shard,
                                          rank_device)
from engine.tensor_parallel_sharding import shard_config

if TYPE_CHECKING:
    from engine.llm_engine import EngineConfig, LLMEngine


@contextlib.contextmanager
def group_engine(model: str, config: "EngineConfig", tp_size: int, kv_cache_bytes: int,
                 threads: int | None = None, progress: Callable[[str], None] | None = None,
                 expert_parallel: bool = False,
                 rebalance_every: int = REBALANCE_INTERVAL_STEPS) -> Iterator["LLMEngine"]:
    """Rank 0's engine over `tp_size` ranks on this host; followers are spawned here and
    gone when the block exits. `kv_cache_bytes` is per rank. `expert_parallel`: rank 0 runs
    the model and its KV pool, the other ranks hold experts (engine/expert_exchange.py),
    copies planned every `rebalance_every` steps. Raises ValueError (the size does not fit
    the model or the host's GPUs, or a host KV tier asked for with tensor parallelism) or
    ModelLoadError before any process is spawned."""
    from engine.engine_builder import load_tokenizer
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.loader import read_model_config

    report = progress or (lambda message: None)
    if config.kv_host_cache_bytes and not expert_parallel:  # the followers' KV is theirs
        raise ValueError("a host KV tier is not supported with tensor parallelism yet")
    # Rank 0's shape (shard_config checks the size fits the model): its KV pool's heads.
    shard = shard_config(read_model_config(model), tp_size, expert_parallel)
    last = rank_device(config.device, tp_size - 1)
    if last.type == "cuda" and (last.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{tp_size} ranks from {config.device} need GPUs up to {last} (one "
                         f"per rank); this host has {torch.cuda.device_count()}")
    dtype_name = str(config.dtype).removeprefix("torch.")
    followers = Followers(tp_size, model, dtype_name, config.device, threads,
                          expert_parallel=expert_parallel)
    connected, engine = False, None
    what = "expert" if expert_parallel else "tensor"
    try:
        device = rank_device(config.device, 0)
        report(f"{what} parallel: waiting for {tp_size - 1} follower rank(s)")
        group = connect(0, tp_size, followers.store, device, expert_parallel=expert_parallel)
        connected = True
        loaded = load_shard(model, group, config.dtype, device)
        num_blocks = EngineConfig.blocks_for_bytes(shard, kv_cache_bytes, config.block_size,
                                                   config.kv_cache_dtype)
        engine_config = dataclasses.replace(config, num_kv_blocks=num_blocks,
                                            device=str(device), cuda_graph_batch_sizes=())
        from engine.model_runner import ModelRunner

        # Tensor parallel: this rank's KV heads only, every step sent to the followers first.
        # Expert parallel: the whole pool, the expert ranks called by the MoE blocks.
        storage = KVStorage.for_model(shard, num_blocks, engine_config.block_size,
                                      engine_config.kv_cache_dtype, engine_config.device)
        runner = DrivingRunner(ModelRunner(loaded.model, storage, engine_config.block_size,
                                           cuda_graph_batch_sizes=()), group,
                                rebalance_every)
        engine = LLMEngine(runner, storage, loaded.config,
                           load_tokenizer(loaded.tokenizer_source), engine_config)
        report(f"{what} parallel: {tp_size} ranks ready")
        yield engine
    finally:
        if engine is not None:
            engine.close()
        # Followers blocked in a collective (rank 0 failed before its first message) would
        # only notice at the group timeout: do not wait for them then.
        codes = followers.stop(timeout_s=30.0 if engine is not None else 0.0)
        if connected:
            dist.destroy_process_group()
        if engine is not None and any(codes):
            report(f"{what} parallel: follower exit codes {codes}")
