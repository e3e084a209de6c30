"""Executes one `ScheduleOutput` on the model and returns the logits to sample from.

Contract: `execute` is called once per scheduler step with that step's schedule. Its only
side effect is writing the K/V of the scheduled tokens into their slots of `KVStorage`
(positions [start_pos, end_pos) of each chunk); every other slot is left untouched, so
blocks shared through prefix caching or owned by other requests are never clobbered.
It keeps no state between steps: the schedule carries everything (positions, block tables).

Paths: on CUDA (with triton) the model runs its Triton kernel path, and it replays CUDA
graphs captured here at start-up: pure decode steps (engine/cuda_graphs.py), and steps with
prefill chunks of up to the step budget (512 tokens and 8 chunks by default; at most 4096
tokens and 32 chunks), decode rows beside them or not (engine/mixed_graphs.py); any other
step (larger ones, a decode batch larger than the largest graph, a step whose layers signal
`on_layer`) runs the kernel path eagerly.
Mixture-of-experts models are captured too: their kernel path groups tokens by expert
on the device (engine/kernels/fused_moe.py).
Elsewhere the torch path runs, the reference. `use_kernels=True` on CPU tensors runs the
kernel path under Triton's interpreter (tests only: it is slow).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention_metadata import AttentionMetadata, kernels_available
from engine.cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphs, capture_phase
from engine.device_upload import to_device
from engine.kv_storage import KVStorage
from engine.mixed_graphs import (DEFAULT_TOKEN_SIZES, MixedGraphs, mixed_decode_sizes,
                                 mixed_prefill_chunks, mixed_token_sizes)
from engine.mixed_split import mixed_split_threshold
from engine.models.decoder import DecoderForCausalLM
from engine.native import placeholder_sources as native_placeholder_sources
from engine.request import PLACEHOLDER
from engine.schedule_output import ScheduleOutput


@dataclass(frozen=True, slots=True)
class DeviceTokens:
    """The previous step's sampled tokens, still on the device (an overlapped step,
    engine/llm_engine.py): a chunk token PLACEHOLDER of request r reads token_ids[rows[r]]."""

    token_ids: torch.Tensor  # long [rows of the previous step]
    rows: Mapping[str, int]


def placeholder_sources(schedule: ScheduleOutput, previous: DeviceTokens | None
                        ) -> tuple[list[int], list[int]]:
    """(positions in the step's flat token list, rows of `previous`) of every PLACEHOLDER.
    A PLACEHOLDER is only ever a decode chunk's one token (engine/scheduler.py): anything
    else raises AssertionError. One compiled pass over the chunks (engine/native)."""
    return native_placeholder_sources(schedule.chunks,
                                      None if previous is None else previous.rows, PLACEHOLDER)


TokenFill = tuple[torch.Tensor | slice, torch.Tensor]  # (rows of the step's tokens, tokens)


def placeholder_fill(previous: DeviceTokens, dst: list[int], src: list[int],
                     device: torch.device) -> TokenFill:
    """Where the PLACEHOLDERs' tokens go in the step's flat token list, and those tokens,
    on the device (`placeholder_sources`' lists). The usual decode step needs no upload:
    its placeholders are its first rows (decodes lead a schedule; `dst` is increasing, so
    it ends at n - 1 only as 0..n-1), and they read the previous step's rows in the same
    order unless a request ended or joined since."""
    n = len(dst)
    rows: torch.Tensor | slice = (slice(0, n) if dst[-1] == n - 1
                                  else to_device(dst, torch.long, device))
    tokens = previous.token_ids
    if src == dst and isinstance(rows, slice):
        return rows, tokens[:n]
    return rows, tokens[to_device(src, torch.long, tokens.device)]


class StepRunner(Protocol):
    """What the engine loop needs from whatever runs the model (this module's ModelRunner,
    or tensor parallelism's DrivingRunner)."""

    @property
    def records_layer_events(self) -> bool:
        """True when `execute` calls `on_layer` after each layer's K/V is queued (CUDA)."""
        ...

    @property
    def reads_device_tokens(self) -> bool:
        """True when `execute` takes `previous` (overlapped steps)."""
        ...

    def execute(self, schedule: ScheduleOutput,
                on_layer: Callable[[int], None] | None = None,
                previous: DeviceTokens | None = None) -> torch.Tensor:
        """float32 logits [sampling chunks, vocab] for one step's schedule: possibly a
        captured step's static output (replayed on CUDA, run eagerly in CPU tests), which
        the next `execute` overwrites, so the caller queues every read of it (the
        sampler's) before calling again. Where `records_layer_events`, `on_layer(n)` runs
        once per layer, in order, right after the work writing layer n's K/V was queued on
        the current stream. A PLACEHOLDER token of the schedule is read from `previous`
        (`placeholder_sources`)."""
        ...

    def close(self) -> None:
        """Release what the runner holds beyond this process; idempotent."""
        ...


class ModelRunner:
    """`cuda_graph_batch_sizes`: None captures DEFAULT_BATCH_SIZES where graphs can run (the
    kernel path on CUDA) and none elsewhere; () captures none. With `use_kernels=True` on
    CPU, sizes given explicitly run the padded graph steps eagerly (see DecodeGraphs).
    `mixed_split_min_tokens`: from what size an eager mixed step's decode rows get the
    decode kernel (engine/mixed_split.py's `split_mixed_step`); None: the model width's
    default (`mixed_split_threshold`). `mixed_graph_tokens`: the largest step with prefill
    chunks captured as a graph (engine/mixed_graphs.py's `mixed_token_sizes`); None: 512
    where graphs can run and none elsewhere, 0: none; given on CPU with `use_kernels=True`,
    the padded steps run eagerly. `use_mixed_graphs` turns their replay off and on at run
    time (the warm-up and benchmarks compare both paths in one process)."""

    def __init__(self, model: DecoderForCausalLM, kv: KVStorage, block_size: int,
                 use_kernels: bool | None = None,
                 cuda_graph_batch_sizes: Sequence[int] | None = None,
                 mixed_split_min_tokens: int | None = None,
                 mixed_graph_tokens: int | None = None) -> None:
        if kv.layout.block_size != block_size:
            raise ValueError(f"KV storage block size {kv.layout.block_size} != {block_size}")
        if kv.layout.num_layers != model.config.num_layers:
            raise ValueError(f"KV storage has {kv.layout.num_layers} layers, "
                             f"the model {model.config.num_layers}")
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.mixed_split_min_tokens = (  # see mixed_split.split_mixed_step
            mixed_split_threshold(model.config.hidden_size) if mixed_split_min_tokens is None
            else mixed_split_min_tokens)
        self.device = model.model.embed_tokens.weight.device
        if model.tp_size > 1:
            # A tensor-parallel shard runs the torch path only (its all-reduces are eager).
            if use_kernels:
                raise ValueError("use_kernels=True with a tensor-parallel model: "
                                 "only the torch path supports tensor parallelism")
            use_kernels = False
        self.use_kernels = kernels_available(self.device) if use_kernels is None else use_kernels
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.use_mixed_graphs = True
        self.capture_seconds = 0.0  # building (on CUDA capturing) both kinds of graphs
        if not self.use_kernels:
            return
        model.prepare_kernels()
        on_cuda = self.device.type == "cuda"
        if cuda_graph_batch_sizes is None:
            cuda_graph_batch_sizes = DEFAULT_BATCH_SIZES if on_cuda else ()
        if mixed_graph_tokens is None:
            mixed_graph_tokens = DEFAULT_TOKEN_SIZES[-1] if on_cuda else 0
        # A table never needs more columns than the pool has blocks or a sequence of the
        # model's longest context needs.
        width = min(kv.layout.num_blocks,
                    math.ceil(model.config.max_position_embeddings / block_size))
        started = time.perf_counter()
        with capture_phase():
            # One memory pool for every graph: they replay one at a time, on one stream.
            pool = torch.cuda.graph_pool_handle() if on_cuda else None
            token_sizes = mixed_token_sizes(mixed_graph_tokens)
            if token_sizes:
                # Largest first: the mixed steps' activations outgrow any decode step's.
                self.mixed_graphs = MixedGraphs(
                    model, kv, block_size, token_sizes, width, use_graphs=on_cuda,
                    decode_sizes=mixed_decode_sizes(max(cuda_graph_batch_sizes, default=0)),
                    max_prefill_chunks=mixed_prefill_chunks(mixed_graph_tokens))
                self.mixed_graphs.capture(pool)
            if cuda_graph_batch_sizes:
                self.graphs = DecodeGraphs(model, kv, block_size, cuda_graph_batch_sizes, width,
                                           use_graphs=on_cuda)
                self.graphs.capture(pool)
        self.capture_seconds = time.perf_counter() - started
        if on_cuda:
            # Eager decode rows (a mixed step's, or a batch past the largest graph) may use
            # any split count: compile them all now rather than one mid-traffic.
            from engine.kernels.paged_decode_attention import compile_split_variants

            config = model.config
            k_cache, v_cache = kv.layer(0)
            windows = tuple({config.window_of(n) for n in range(config.num_layers)})
            compile_split_variants(torch.empty(1, config.num_heads, config.head_dim,
                                               dtype=model.model.embed_tokens.weight.dtype,
                                               device=self.device),
                                   k_cache, v_cache, config.attn_logit_softcap, windows)

    @property
    def records_layer_events(self) -> bool:
        return self.device.type == "cuda"

    @property
    def reads_device_tokens(self) -> bool:
        return True

    def execute(self, schedule: ScheduleOutput,
                on_layer: Callable[[int], None] | None = None,
                previous: DeviceTokens | None = None) -> torch.Tensor:
        """float32 logits [number of chunks with sample=True, vocab], in chunk order.

        Each row is the distribution after the last token of a sampling chunk. An empty
        schedule, or one without sampling chunks, returns an empty [0, vocab] tensor.
        PLACEHOLDER tokens are read from `previous`, on the device (`placeholder_sources`).
        """
        vocab = self.model.config.vocab_size
        if schedule.is_empty:
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        dst, src = placeholder_sources(schedule, previous)
        fill = None
        if dst:
            assert previous is not None  # placeholder_sources checked it
            fill = placeholder_fill(previous, dst, src, self.device)
        if on_layer is None and self.graphs is not None and self.graphs.can_run(schedule):
            return self.graphs.run(schedule, fill)
        if on_layer is None and self.mixed_graphs is not None and self.use_mixed_graphs:
            logits = self.mixed_graphs.try_run(schedule, fill)
            if logits is not None:
                return logits
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in schedule.chunks:
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            if chunk.sample:
                sample_rows.append(len(input_ids) - 1)
        attn = AttentionMetadata.from_schedule(schedule, self.block_size, self.device,
                                               use_kernels=self.use_kernels,
                                               num_kv_heads=self.model.config.num_kv_heads,
                                               mixed_split_min_tokens=self.mixed_split_min_tokens)
        # Every upload before the model is queued, and none waits for the device
        # (device_upload.py): this call returns once the step is queued, so the KVReady
        # that follows it (engine/kv_ready.py) and an overlapped step's host work do not
        # wait for the previous step to finish.
        rows = to_device(sample_rows, torch.long, self.device)
        ids = to_device(input_ids, torch.long, self.device)
        if fill is not None:
            ids[fill[0]] = fill[1]
        with torch.inference_mode():
            hidden = self.model(ids, to_device(positions, torch.long, self.device),
                                self.kv, attn, on_layer)
            if not sample_rows:
                return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
            # Only sampled rows pay for the vocabulary projection (the largest matmul).
            return self.model.compute_logits(hidden[rows])

    def close(self) -> None:
        return None  # nothing outside this process
