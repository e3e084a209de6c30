"""CUDA graphs for the steps that are not pure decodes: prefill chunks, alone or beside decode rows.

Launched eagerly from Python, a step costs about ten kernel launches per layer (170 on a
16-layer model) plus its attention metadata; on a small model that host time, not the
GPU, sets the length of every step that carries a new prompt (docs/benchmark_journal.md "The
serving loop"). Here a step of up to `max(token_sizes)` tokens with up to
`max_prefill_chunks` prefill chunks replays a graph captured for its padded shape
`(T tokens, D decode rows)`, one launch for the whole step. Every input lives in one
static int32 buffer, refilled before each replay:

    static ints    [ input_ids | positions | slot_mapping ]       T_max each
                   [ decode_context_lens | sample_rows ]           D_max, D_max + P
                   [ prefill_cu_seqlens | prefill_context_lens ]   P + 1, P
                   [ decode_tables | prefill_tables ]              D_max x W, P x W

    token rows     [0, d)    the step's d decode rows (its leading one-token chunks), in
                             the decode kernel, which runs over D >= d rows: rows [d, D)
                             have context 0 and get zeros, which the prefill kernel then
                             overwrites where they are prefill tokens
                   [d, n)    the p prefill chunks' tokens, in the prefill kernel, which
                             reads absolute rows from prefill_cu_seqlens (it starts at d)
                   [n, T)    padding: token 0 at position 0, slot -1 (the KV write skips it)
    prefill slots  [p, P)    empty: cu_seqlens repeats n and context is 0; they exit at once
    sample_rows    the rows whose logits are sampled, in chunk order; the rest name row 0

The logits of every graph land in one static float32 buffer [D_max + P, vocab], allocated
outside the graph pool; `run` returns a copy of the sampled rows. A step's shape is the
smallest captured D >= d, then the smallest T >= max(n, D); a graph exists for every
(T, D) with D <= T. In a graph a mixed step's decode rows always take the decode kernel
(the eager path keeps small ones in the prefill kernel only to save launches).

Lifecycle: constructed (buffers allocated) -> `capture(pool)` exactly once, at start-up,
after the KV pool exists -> `try_run(schedule)` for every step (None, nothing done, for
a step with no captured shape). Without CUDA (`use_graphs=False`: Triton's interpreter in
tests) it executes the very same padded step eagerly.

Invariants: token and decode sizes are sorted and unique, the decode sizes start at 0 and
no token size is below 2 (a one-token step is a decode); after capture a step exists for
every (T, D <= T); after a run, the host buffer's rows past the step are padding (slot -1,
context 0, empty prefill slots).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_metadata import (AttentionMetadata, KernelAttentionMetadata,
                                       choose_decode_splits, chunk_slots)
from engine.block_table_rows import BlockTableRows
from engine.cuda_graphs import capture_step, padded_batch_size
from engine.device_upload import copy_to_device
from engine.kv_storage import KVStorage
from engine.models.decoder import DecoderForCausalLM
from engine.native import fill_decode_rows
from engine.schedule_output import BLOCK_IDS, ScheduledChunk, ScheduleOutput

# Token counts of the captured steps: every 64 tokens from 128 (a padded token costs its
# share of a step's matmuls, so the steps grow finely where they are compute-bound).
DEFAULT_TOKEN_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
# Decode rows of the captured steps: a padded decode row has context 0 and its programs
# exit at once, so coarse sizes cost little; they only set the decode kernel's split-K.
DEFAULT_DECODE_SIZES = (0, 4, 16, 64, 256)
# Prefill chunks a captured step of up to 512 tokens holds; a step with more runs eagerly.
MAX_PREFILL_CHUNKS = 8
# Past 512 tokens (a --max-num-batched-tokens above the default): every 128 tokens to 1024,
# then every 256, up to this many; longer steps run eagerly. On a small model a 2048-token
# step launched kernel by kernel is bound by its launches, as a short one is.
MAX_CAPTURED_TOKENS = 4096


def mixed_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """Pure policy: the token counts to capture for steps of at most `max_tokens` (an
    engine's max_num_batched_tokens): DEFAULT_TOKEN_SIZES, then past 512 every 128 tokens
    to 1024 and every 256 after, up to max_tokens (at most MAX_CAPTURED_TOKENS)."""
    if max_tokens < 2:
        return ()
    if max_tokens <= DEFAULT_TOKEN_SIZES[-1]:
        return tuple(s for s in DEFAULT_TOKEN_SIZES if s < max_tokens) + (max_tokens,)
    top = min(max_tokens, MAX_CAPTURED_TOKENS)
    larger = [*range(640, min(top, 1024) + 1, 128), *range(1280, top + 1, 256)]
    return DEFAULT_TOKEN_SIZES + tuple(sorted({*larger, top}))


def mixed_prefill_chunks(max_tokens: int) -> int:
    """Pure policy: the prefill chunks a captured step holds, for steps of at most
    `max_tokens` tokens: MAX_PREFILL_CHUNKS, and one per 64 tokens past 512 (at most 32),
    so that a long step of short prompts is captured too (an empty slot exits at once)."""
    return max(MAX_PREFILL_CHUNKS, min(32, min(max_tokens, MAX_CAPTURED_TOKENS) // 64))


def mixed_decode_sizes(max_decode_rows: int) -> tuple[int, ...]:
    """Pure policy: the decode row counts a captured mixed step may hold beside its prompts:
    DEFAULT_DECODE_SIZES, and the largest decode batch where it is larger (a batch of more
    than 256 seats, --max-num-seqs)."""
    if max_decode_rows > DEFAULT_DECODE_SIZES[-1]:
        return DEFAULT_DECODE_SIZES + (max_decode_rows,)
    return DEFAULT_DECODE_SIZES


def captured_decode_sizes(token_sizes: Sequence[int],
                          decode_sizes: Sequence[int] = DEFAULT_DECODE_SIZES) -> tuple[int, ...]:
    """The decode row counts captured beside `token_sizes`: 0 and those below the largest
    token size (a step has at least one prefill token). Pure."""
    largest = max(token_sizes, default=0)
    return tuple(sorted({0, *(d for d in decode_sizes if d < largest)}))


def logits_rows(max_tokens: int, max_decode_rows: int = DEFAULT_DECODE_SIZES[-1]) -> int:
    """Rows of the mixed graphs' static logits for an engine's step budget and largest
    decode batch (0: no graphs); the memory plan reserves them. Pure."""
    sizes = mixed_token_sizes(max_tokens)
    if not sizes:
        return 0
    return (captured_decode_sizes(sizes, mixed_decode_sizes(max_decode_rows))[-1]
            + mixed_prefill_chunks(max_tokens))


@dataclass(frozen=True, slots=True)
class MixedShape:
    """The padded shape of a captured step."""

    num_tokens: int  # T
    num_decode_rows: int  # D


def padded_shape(num_tokens: int, num_decodes: int, token_sizes: Sequence[int],
                 decode_sizes: Sequence[int]) -> MixedShape | None:
    """The captured shape that holds a step of `num_tokens` tokens whose first
    `num_decodes` are decode rows; None when none does. Pure."""
    d = padded_batch_size(num_decodes, decode_sizes)
    if d is None:
        return None
    t = padded_batch_size(max(num_tokens, d), token_sizes)
    return None if t is None else MixedShape(t, d)


class MixedGraphs:
    """Captured prefill and mixed steps of one model over one KV pool."""

    def __init__(self, model: DecoderForCausalLM, kv: KVStorage, block_size: int,
                 token_sizes: Sequence[int], max_blocks_per_seq: int, use_graphs: bool,
                 decode_sizes: Sequence[int] = DEFAULT_DECODE_SIZES,
                 max_prefill_chunks: int = MAX_PREFILL_CHUNKS) -> None:
        self.token_sizes = tuple(sorted(set(token_sizes)))
        self.decode_sizes = captured_decode_sizes(self.token_sizes, decode_sizes)
        if not self.token_sizes or self.token_sizes[0] < 2:
            raise ValueError(f"mixed graphs need token sizes of at least 2, got {token_sizes}")
        if max_blocks_per_seq < 1 or max_prefill_chunks < 1:
            raise ValueError("mixed graphs need a positive table width and prefill chunk count")
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_prefill_chunks = max_prefill_chunks
        self.use_graphs = use_graphs
        self.device = model.model.embed_tokens.weight.device
        t, d, p, w = (self.token_sizes[-1], self.decode_sizes[-1], max_prefill_chunks,
                      max_blocks_per_seq)
        self._host = _Views(np.zeros(_Views.length(t, d, p, w), dtype=np.int32), t, d, p, w)
        self._tables = BlockTableRows()  # fills self._host.decode_tables
        self._host.reset_padding(0, 0, 0, 0)
        self._ints = torch.from_numpy(self._host.flat).to(self.device, copy=True)
        self._device_views = _Views(self._ints, t, d, p, w)
        self._logits = torch.empty(d + p, model.config.vocab_size, dtype=torch.float32,
                                   device=self.device)
        self._steps: dict[MixedShape, Callable[[], torch.Tensor]] = {}
        self._graphs: dict[MixedShape, torch.cuda.CUDAGraph] = {}
        self._live = (0, 0, 0, 0)  # the last run's (tokens, decode rows, prefill chunks, samples)
        self.captured = False
        self.pool_bytes = 0  # device memory the capture took (graph pool and warm-up)
        self.num_runs = 0  # steps run since start-up

    @property
    def shapes(self) -> tuple[MixedShape, ...]:
        """Every captured shape, largest first (the order they are captured in)."""
        return tuple(MixedShape(t, d) for t in reversed(self.token_sizes)
                     for d in reversed(self.decode_sizes) if d <= t)

    def captured_graphs(self) -> list[torch.cuda.CUDAGraph]:
        """The CUDA graphs replayed by `try_run`, one per shape (none off CUDA)."""
        return list(self._graphs.values())

    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Build (and on CUDA capture, then replay once so that its first use is not the
        graph's upload) one step per shape; called exactly once. `pool`: a graph memory
        pool shared with the runner's decode graphs (replays never overlap: one stream)."""
        if self.captured:
            raise RuntimeError("mixed graphs are captured exactly once")
        before = torch.cuda.memory_reserved(self.device) if self.use_graphs else 0
        if self.use_graphs and pool is None:
            pool = torch.cuda.graph_pool_handle()
        for shape in self.shapes:
            step = self._make_step(shape)
            self._steps[shape] = step
            if self.use_graphs:
                graph, _ = capture_step(step, pool, self.device)
                graph.replay()  # all padding: writes no K/V, reads none
                self._graphs[shape] = graph
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        self.captured = True

    def shape_for(self, schedule: ScheduleOutput) -> MixedShape | None:
        """The captured shape that runs `schedule`; None for a pure decode step (the decode
        graphs' work), a step too large or with too many prefill chunks, or before capture.
        Side-effect free."""
        return self._shape(schedule, schedule.num_leading_decodes)

    def try_run(self, schedule: ScheduleOutput,
                fill: tuple[torch.Tensor | slice, torch.Tensor] | None = None
                ) -> torch.Tensor | None:
        """float32 logits [sampling chunks, vocab], in chunk order, from a replay (or,
        without graphs, a run) of the step of `shape_for(schedule)`: a view of the static
        logits, overwritten by the next run; None, with nothing done, where that is None.
        `fill` (flat token positions as indices or a slice, token ids, on the device)
        overwrites those input ids: decode rows whose token the previous step sampled and
        the host has not seen yet."""
        num_decodes = schedule.num_leading_decodes
        shape = self._shape(schedule, num_decodes)
        if shape is None:
            return None
        num_samples = self._fill(schedule.chunks, num_decodes)
        if fill is not None:
            self._device_views.input_ids[fill[0]] = fill[1].to(self._ints.dtype)
        self.num_runs += 1
        if self.use_graphs:
            self._graphs[shape].replay()
        else:
            with torch.inference_mode():
                self._steps[shape]()
        # The static logits themselves: read before the next replay (StepRunner.execute).
        return self._logits[:num_samples]

    def _shape(self, schedule: ScheduleOutput, num_decodes: int) -> MixedShape | None:
        chunks = schedule.chunks
        num_prefills = len(chunks) - num_decodes
        if not self.captured or not 0 < num_prefills <= self.max_prefill_chunks:
            return None
        if schedule.max_table_len > self.max_blocks_per_seq:
            return None
        return padded_shape(schedule.num_tokens, num_decodes, self.token_sizes,
                            self.decode_sizes)

    def _fill(self, chunks: tuple[ScheduledChunk, ...], num_decodes: int) -> int:
        """Write the step into the static buffers (host, then device); returns the number
        of sampled rows."""
        host, bs = self._host, self.block_size
        # The decode rows (most of a step) in one compiled pass (engine/native): token,
        # position, KV slot, context length; None: every one samples.
        decode_samples = fill_decode_rows(chunks, num_decodes, bs, host.input_ids,
                                          host.positions, host.slot_mapping,
                                          host.decode_context_lens)
        sample_rows = list(range(num_decodes)) if decode_samples is None else decode_samples
        # The widest table of each part.
        decode_width = self._tables.write(host.decode_tables, chunks[:num_decodes],
                                          field=BLOCK_IDS)
        prefill_width = 0
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [num_decodes]
        for i, chunk in enumerate(chunks[num_decodes:]):
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            slots.extend(chunk_slots(chunk.block_ids, chunk.start_pos, chunk.end_pos, bs))
            host.prefill_tables[i, :len(chunk.block_ids)] = chunk.block_ids
            prefill_width = max(prefill_width, len(chunk.block_ids))
            cu_seqlens.append(cu_seqlens[-1] + len(chunk.token_ids))
            if chunk.sample:
                sample_rows.append(cu_seqlens[-1] - 1)
        num_tokens, num_prefills = cu_seqlens[-1], len(chunks) - num_decodes
        host.input_ids[num_decodes:num_tokens] = token_ids
        host.positions[num_decodes:num_tokens] = positions
        host.slot_mapping[num_decodes:num_tokens] = slots
        host.prefill_cu_seqlens[:num_prefills + 1] = cu_seqlens
        host.prefill_context_lens[:num_prefills] = [c.end_pos for c in chunks[num_decodes:]]
        host.sample_rows[:len(sample_rows)] = sample_rows
        host.reset_padding(num_tokens, num_decodes, num_prefills, len(sample_rows))
        self._live = (num_tokens, num_decodes, num_prefills, len(sample_rows))
        self._upload((num_decodes, decode_width), (num_prefills, prefill_width))
        return len(sample_rows)

    def check_invariants(self) -> None:
        if list(self.token_sizes) != sorted(set(self.token_sizes)) or self.token_sizes[0] < 2:
            raise AssertionError(f"bad token sizes: {self.token_sizes}")
        if list(self.decode_sizes) != sorted(set(self.decode_sizes)) or self.decode_sizes[0]:
            raise AssertionError(f"bad decode sizes: {self.decode_sizes}")
        if self.captured and set(self._steps) != set(self.shapes):
            raise AssertionError("a captured shape has no step")
        if self.use_graphs and self.captured and set(self._graphs) != set(self.shapes):
            raise AssertionError("a captured shape has no graph")
        self._host.check_padding(*self._live)
        self._tables.check_table(self._host.decode_tables)

    def _upload(self, decode_part: tuple[int, int], prefill_part: tuple[int, int]) -> None:
        """The scalars, then only the table rows and columns this step uses; each part is
        (rows, widest table)."""
        host, dev = self._host, self._device_views
        copy_to_device(dev.scalars, host.scalars)
        for (rows, width), host_table, dev_table in (
                (decode_part, host.decode_tables, dev.decode_tables),
                (prefill_part, host.prefill_tables, dev.prefill_tables)):
            if rows:
                copy_to_device(dev_table[:rows, :width],
                               np.ascontiguousarray(host_table[:rows, :width]))

    def _make_step(self, shape: MixedShape) -> Callable[[], torch.Tensor]:
        dev = self._device_views
        t, d = shape.num_tokens, shape.num_decode_rows
        config = self.model.config
        # max_query_len = T bounds the prefill grid: no chunk of the step is longer.
        prefill = KernelAttentionMetadata(
            slot_mapping=dev.slot_mapping[:t], block_tables=dev.prefill_tables,
            context_lens=dev.prefill_context_lens, cu_seqlens_q=dev.prefill_cu_seqlens,
            max_query_len=t, num_decode_splits=1)
        kernels = prefill
        if d:
            splits = choose_decode_splits(d, config.num_kv_heads,
                                          self.max_blocks_per_seq * self.block_size, self.device)
            kernels = KernelAttentionMetadata(
                slot_mapping=dev.slot_mapping[:t], block_tables=dev.decode_tables[:d],
                context_lens=dev.decode_context_lens[:d],
                cu_seqlens_q=dev.decode_context_lens[:0], max_query_len=t,
                num_decode_splits=splits, num_decode_chunks=d, prefill_part=prefill,
                prefill_rows_absolute=True)
        attn = AttentionMetadata(slot_mapping=dev.slot_mapping[:t], query_start=(),
                                 start_pos=(), end_pos=(), block_tables=(),
                                 block_size=self.block_size, groups=(), kernels=kernels)
        input_ids, positions = dev.input_ids[:t], dev.positions[:t]
        rows = dev.sample_rows[:d + self.max_prefill_chunks]
        logits = self._logits[:d + self.max_prefill_chunks]

        def step() -> torch.Tensor:
            hidden = self.model(input_ids, positions, self.kv, attn)
            return self.model.compute_logits(hidden.index_select(0, rows), out=logits)

        return step


class _Views:
    """Named views into one flat int32 buffer (numpy on the host, torch on the device); the
    layout is the module docstring's."""

    @staticmethod
    def sizes(t: int, d: int, p: int, w: int) -> list[int]:
        """The parts' lengths, in the buffer's order."""
        return [t, t, t, d, d + p, p + 1, p, d * w, p * w]

    @staticmethod
    def length(t: int, d: int, p: int, w: int) -> int:
        return sum(_Views.sizes(t, d, p, w))

    def __init__(self, flat, t: int, d: int, p: int, w: int) -> None:
        self.flat = flat
        ends = np.cumsum(_Views.sizes(t, d, p, w))
        parts = [flat[lo:hi] for lo, hi in zip([0, *ends[:-1]], ends)]
        (self.input_ids, self.positions, self.slot_mapping, self.decode_context_lens,
         self.sample_rows, self.prefill_cu_seqlens, self.prefill_context_lens) = parts[:7]
        self.decode_tables = parts[7].reshape(d, w)
        self.prefill_tables = parts[8].reshape(p, w)
        self.scalars = flat[:int(ends[6])]

    def reset_padding(self, num_tokens: int, num_decodes: int, num_prefills: int,
                      num_samples: int) -> None:
        """Everything past the live rows becomes padding: never written, attends to nothing."""
        self.input_ids[num_tokens:] = 0
        self.positions[num_tokens:] = 0
        self.slot_mapping[num_tokens:] = -1
        self.decode_context_lens[num_decodes:] = 0
        self.prefill_cu_seqlens[num_prefills + 1:] = num_tokens
        self.prefill_context_lens[num_prefills:] = 0
        self.sample_rows[num_samples:] = 0

    def check_padding(self, num_tokens: int, num_decodes: int, num_prefills: int,
                      num_samples: int) -> None:
        if (self.slot_mapping[num_tokens:] != -1).any():
            raise AssertionError("a padding token has a KV slot")
        if self.decode_context_lens[num_decodes:].any() or \
                self.prefill_context_lens[num_prefills:].any():
            raise AssertionError("a padding row attends to something")
        if (self.prefill_cu_seqlens[num_prefills + 1:] != num_tokens).any():
            raise AssertionError("an empty prefill slot has query rows")
        if self.sample_rows[num_samples:].any():
            raise AssertionError("a padding sample row names a token")
