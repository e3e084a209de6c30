"""CUDA graphs for decode steps: one captured graph per batch size, replayed on padded batches.

A decode step of a large model launches hundreds of kernels; issued one by one from Python
it is bound by the host, not the GPU. Each graph replays a whole step (embedding, every
layer, final norm, logits) with one launch. A graph reads its inputs from fixed addresses,
so every input lives in one static int32 buffer, refilled before each replay:

    static ints   [ input_ids | positions | slot_mapping | context_lens | block_tables ]
                    max_batch   max_batch   max_batch      max_batch      max_batch x W
    row r < n     the r-th chunk of the step (position = start_pos, context = end_pos)
    row r >= n    padding up to the captured size B: token 0 at position 0, slot -1 (the
                  KV write skips it), context 0 (attention returns zeros for it)
    block_tables  W = max_blocks_per_seq columns; row r columns past its table are stale
                  but never read (positions < context_lens[r] only)

Lifecycle: constructed (buffers allocated) -> `capture()` exactly once, at start-up, after
the KV pool exists (graphs bake in its address) -> `run(schedule)` for every decode step
that `can_run`. Graphs are captured largest first into one shared memory pool, so they
cost about one step's activations in all, not one per size; their logits go to one
static buffer outside the pool, [largest size, vocab] float32.

Invariants: `batch_sizes` is sorted and unique; a graph exists for each size after capture;
padding rows always carry slot -1 and context 0 when a graph is replayed.

Without CUDA (`use_graphs=False`, e.g. Triton's interpreter on CPU) `run` executes the very
same padded step eagerly, so the buffer logic is testable where graphs are not.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Callable

import numpy as np
import torch

from engine.attention_metadata import (AttentionMetadata, KernelAttentionMetadata,
                                       choose_decode_splits)
from engine.block_table_rows import BlockTableRows
from engine.device_upload import copy_to_device, to_device
from engine.kv_storage import KVStorage
from engine.models.decoder import DecoderForCausalLM
from engine.native import fill_decode_rows
from engine.schedule_output import BLOCK_IDS, ScheduleOutput

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Past 256 rows (a --max-num-seqs above the GPU default) every 64 rows up to this many; a
# larger decode batch runs eagerly.
MAX_CAPTURED_BATCH = 1024


def decode_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Pure policy: the decode batch sizes to capture for batches of at most `max_num_seqs`
    rows: DEFAULT_BATCH_SIZES, then past 256 every 64 rows up to max_num_seqs (at most
    MAX_CAPTURED_BATCH). A decode step larger than every size runs eagerly, and on a small
    model its launches, not the GPU, then set its length."""
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    if top <= DEFAULT_BATCH_SIZES[-1]:
        return DEFAULT_BATCH_SIZES
    return DEFAULT_BATCH_SIZES + tuple(sorted({*range(320, top + 1, 64), top}))


def padded_batch_size(num_seqs: int, batch_sizes: Sequence[int]) -> int | None:
    """Smallest captured size that holds `num_seqs` rows; None when none does. Pure."""
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) else None


@contextlib.contextmanager
def capture_phase() -> Iterator[None]:
    """Around a batch of captures: no cyclic garbage collection inside it.

    A collection frees whatever it finds unreachable, CUDA objects included (events,
    pinned host buffers whose release queries their events), in the middle of a capture;
    a call the capture forbids invalidates it. Collected once before, off during, back to
    the state found after."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_step(step: Callable[[], torch.Tensor], pool: tuple[int, int] | None,
                 device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one step into a graph of the memory pool `pool`: (the graph, the output
    tensor its replays overwrite). The step runs once first, on a side stream and outside
    the capture: Triton compiles its kernels and cuBLAS picks its algorithms then, neither
    of which may happen while capturing. Only this thread's calls are checked against the
    capture ("thread_local"): another thread of the process (a worker's event loop polling
    a KV copy's event) may go on using the device meanwhile."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool,
                                                  capture_error_mode="thread_local"):
        output = step()
    return graph, output


class DecodeGraphs:
    """Captured decode steps of one model over one KV pool."""

    def __init__(self, model: DecoderForCausalLM, kv: KVStorage, block_size: int,
                 batch_sizes: Sequence[int], max_blocks_per_seq: int, use_graphs: bool) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"decode graphs need positive batch sizes, got {batch_sizes}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be positive, got {max_blocks_per_seq}")
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.use_graphs = use_graphs
        self.device = model.model.embed_tokens.weight.device
        b, w = self.max_batch_size, max_blocks_per_seq
        self._host = np.zeros(4 * b + b * w, dtype=np.int32)
        self._ints = torch.zeros(4 * b + b * w, dtype=torch.int32, device=self.device)
        # Every graph writes its logits here, outside the graph pool: one buffer for all
        # sizes, not one per size held in the pool (0.6 GB with a 128k vocabulary).
        self._logits = torch.empty(b, model.config.vocab_size, dtype=torch.float32,
                                   device=self.device)
        self._views = _Views(self._host, b, w)
        self._tables = BlockTableRows()  # fills self._views.block_tables
        self._views.reset_padding(0)
        self._ints.copy_(torch.from_numpy(self._host))
        self._device_views = _Views(self._ints, b, w)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captured = False
        self.pool_bytes = 0  # device memory the capture took (graph pool and warm-up)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def captured_graphs(self) -> list[torch.cuda.CUDAGraph]:
        """The CUDA graphs replayed by `run`, one per batch size (none off CUDA)."""
        return [graph for graph, _ in self._graphs.values()]

    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Build (and on CUDA capture) one step per batch size; called exactly once. `pool`:
        a graph memory pool shared with other graphs of this runner (engine/mixed_graphs.py);
        None: one of its own."""
        if self.captured:
            raise RuntimeError("decode graphs are captured exactly once")
        before = torch.cuda.memory_reserved(self.device) if self.use_graphs else 0
        if self.use_graphs and pool is None:
            pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            step = self._make_step(size)
            self._steps[size] = step
            if self.use_graphs:
                self._graphs[size] = capture_step(step, pool, self.device)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        self.captured = True

    def can_run(self, schedule: ScheduleOutput) -> bool:
        """True for a pure decode step that fits a captured size and the table width."""
        num_chunks = len(schedule.chunks)
        return (self.captured and 0 < num_chunks <= self.max_batch_size
                and schedule.num_tokens == num_chunks  # one token each
                and schedule.max_table_len <= self.max_blocks_per_seq)

    def run(self, schedule: ScheduleOutput,
            fill: tuple[torch.Tensor | slice, torch.Tensor] | None = None) -> torch.Tensor:
        """float32 logits [number of sampling chunks, vocab]: replay (or, without graphs, run)
        the step of the smallest captured size >= the batch; when every row samples, a view
        of the static output, overwritten by the next run. Requires `can_run`. `fill`
        (rows as indices or a slice, token ids, on the device) overwrites those rows' input
        ids: a decode row's token sampled by the previous step and not on the host yet
        (model_runner.py)."""
        if not self.can_run(schedule):
            raise ValueError("decode graphs: this schedule is not a decode step that fits")
        chunks = schedule.chunks
        num_seqs = len(chunks)
        size = padded_batch_size(num_seqs, self.batch_sizes)
        assert size is not None  # can_run checked the largest size
        host = self._views
        # Each row's token, position, KV slot and context length, in one compiled pass
        # (engine/native); None: every row samples.
        sample_rows = fill_decode_rows(chunks, num_seqs, self.block_size, host.input_ids,
                                       host.positions, host.slot_mapping, host.context_lens)
        width = max(1, self._tables.write(host.block_tables, chunks, field=BLOCK_IDS))
        host.reset_padding(num_seqs)
        dev = self._device_views
        # Two copies: the per-row scalars, then only the table columns this batch uses.
        copy_to_device(dev.scalars, host.scalars)
        copy_to_device(dev.block_tables[:num_seqs, :width],
                       np.ascontiguousarray(host.block_tables[:num_seqs, :width]))
        if fill is not None:
            dev.input_ids[fill[0]] = fill[1].to(dev.input_ids.dtype)
        if self.use_graphs:
            graph, logits = self._graphs[size]
            graph.replay()
        else:
            with torch.inference_mode():
                logits = self._steps[size]()
        if sample_rows is None:
            # The static output itself (no copy of batch x vocabulary floats per step): the
            # caller queues its reads before the next replay (StepRunner.execute).
            return logits[:num_seqs]
        return logits.index_select(0, to_device(sample_rows, torch.long, logits.device))

    def check_invariants(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise AssertionError(f"batch sizes not sorted and unique: {self.batch_sizes}")
        if self.captured and set(self._steps) != set(self.batch_sizes):
            raise AssertionError("a captured size has no step")
        if self.use_graphs and self.captured and set(self._graphs) != set(self.batch_sizes):
            raise AssertionError("a captured size has no graph")
        self._tables.check_table(self._views.block_tables)

    def _make_step(self, size: int) -> Callable[[], torch.Tensor]:
        dev = self._device_views
        config = self.model.config
        splits = choose_decode_splits(size, config.num_kv_heads,
                                      self.max_blocks_per_seq * self.block_size, self.device)
        kernels = KernelAttentionMetadata.for_decode(
            dev.slot_mapping[:size], dev.block_tables[:size], dev.context_lens[:size], splits)
        attn = AttentionMetadata(slot_mapping=dev.slot_mapping[:size], query_start=(),
                                 start_pos=(), end_pos=(), block_tables=(),
                                 block_size=self.block_size, groups=(), kernels=kernels)
        input_ids, positions = dev.input_ids[:size], dev.positions[:size]
        logits = self._logits[:size]

        def step() -> torch.Tensor:
            hidden = self.model(input_ids, positions, self.kv, attn)
            return self.model.compute_logits(hidden, out=logits)

        return step


class _Views:
    """Named views into one flat int32 buffer (numpy on the host, torch on the device)."""

    def __init__(self, flat, max_batch: int, width: int) -> None:
        b = max_batch
        self.scalars = flat[:4 * b]
        self.input_ids = flat[:b]
        self.positions = flat[b:2 * b]
        self.slot_mapping = flat[2 * b:3 * b]
        self.context_lens = flat[3 * b:4 * b]
        self.block_tables = flat[4 * b:].reshape(b, width)

    def reset_padding(self, num_live: int) -> None:
        """Rows from `num_live` on become padding: never written, attend to nothing."""
        self.input_ids[num_live:] = 0
        self.positions[num_live:] = 0
        self.slot_mapping[num_live:] = -1
        self.context_lens[num_live:] = 0
