"""The copies of one mapped transfer: the sender writes the receiver's blocks itself.

With the receiver's pool mapped (pool_mapping.py), a layer range moves in one pass: on CUDA
one kernel (engine/kernels/block_copy.py) queued on the sender's copy stream, then an event
polled from the event loop (no stream synchronize, no thread); on the host one strided
copy per block run, on the sender's copy thread so the event loop never waits long on a
memcpy (a copy of up to INLINE_COPY_BYTES runs on the loop: the hand-off costs more).

    copy(layers)  ─ CUDA: kernel on `stream`, event recorded ─ poll event ─▶ returns
                  └ host: copy_runs on the copy thread (up to 2 MiB: inline) ▶ returns
    copy_after(layers, events)  (CUDA; layer-wise push, engine/kv_ready.py)
                  ─ per layer n: stream waits for events[n], then its kernel ─
                    event recorded ─ a thread waits for it ─────────────────▶ returns

On CUDA the launches go through the link's `BlockCopier` (made once when the pool is mapped:
the layout checks and word views are not redone per transfer or per layer), on the copy
stream made current once per call (`torch.cuda.stream` also makes its device current).

Precondition of `copy` (that of SendHandle.send_layer): the source layers are written, and
on CUDA their producing stream synchronized, so the copy stream needs no wait. `copy_after`
needs only that each event was recorded behind the work that writes its layer: the GPU
orders the copy of layer n after layer n's compute, with no CPU in between, so it overlaps
the layers still computing. Both return only once no byte of that call can still be
written: the sender's drain (outbound.py) and the receiver's release rely on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from engine.kernels.block_copy import BlockCopier
from kv_transfer.interface import TransferSpec
from kv_transfer.layout import BlockRun, plan_runs

# Polling a CUDA event: every loop iteration (other tasks still run in between) for the
# first SPIN_S, then every POLL_S. The spin covers every copy of one request (20 ms moves
# ~30 GB on an H200): uvloop's timers tick in whole milliseconds, so a sleeping poll would
# add up to a millisecond to a copy of half a millisecond (measured: 1 GiB took 1.46 ms
# with a 0.5 ms spin, against 0.52 ms for the copy alone).
SPIN_S = 0.02
POLL_S = 0.001
# Host copies up to this size run on the event loop itself (through numpy), the rest on
# the copy thread: handing a copy to the thread and back (two wake-ups, the interpreter
# lock passed twice) cost ~100 us at the median and up to 3 ms on a 2-core machine, more
# than a 1 MiB copy (~70 us inline); 2 MiB holds the loop ~0.15 ms there.
INLINE_COPY_BYTES = 2 << 20


def copies_inline(num_bytes: int) -> bool:
    """Host path: whether a copy of `num_bytes` runs on the event loop (see above)."""
    return num_bytes <= INLINE_COPY_BYTES


def _as_numpy(pool: torch.Tensor) -> np.ndarray:
    """The pool's elements as same-sized integers in numpy (no copy; bf16 has no numpy type;
    an FP8 pool is bytes already)."""
    return pool.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[pool.element_size()]
                     ).numpy()


def copy_runs_inline(src: np.ndarray, dst: np.ndarray, runs: list[BlockRun],
                     layers: range) -> None:
    """`copy_runs` through numpy: one thread, the caller's (torch's copy would start its
    OpenMP team on the event loop's thread beside the copy thread's, and the idle team of
    one slows the other: a 16 MiB threaded copy ran 20% slower after 1 MiB ones inline)."""
    l0, l1 = layers.start, layers.stop
    for run in runs:
        dst[l0:l1, :, run.dst_start:run.dst_start + run.num_blocks] = \
            src[l0:l1, :, run.src_start:run.src_start + run.num_blocks]


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[BlockRun], layers: range) -> None:
    """Host path: one strided copy per run of blocks, over all `layers` (synchronous)."""
    l0, l1 = layers.start, layers.stop
    for run in runs:
        dst[l0:l1, :, run.dst_start:run.dst_start + run.num_blocks].copy_(
            src[l0:l1, :, run.src_start:run.src_start + run.num_blocks])


class CopyContext:
    """One per sender: the CUDA copy stream, or the host copy thread."""

    def __init__(self, device: torch.device, executor: Executor | None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.executor = executor

    def synchronize(self) -> None:
        """Wait until every copy queued so far finished (before unmapping a pool)."""
        if self.stream is not None:
            self.stream.synchronize()


class MappedCopy:
    def __init__(self, spec: TransferSpec, src: torch.Tensor, dst: torch.Tensor,
                 context: CopyContext, copier: BlockCopier | None = None) -> None:
        """`copier` (CUDA): the link's, from `src` into `dst`; None makes one."""
        self.spec, self.src, self.dst, self.context = spec, src, dst, context
        if context.stream is not None:
            self.copier = copier if copier is not None else BlockCopier(src, dst)
            self._done = torch.cuda.Event()
            # Uploaded on the copy stream (ordered before this transfer's kernels there)
            # from pinned memory, so the host never waits: a pageable upload on the
            # default stream would first wait for whatever the engine queued on it (a
            # whole prefill step, for a push that starts mid-step).
            host = torch.tensor([spec.src_block_ids, spec.dst_block_ids],
                                dtype=torch.int32).pin_memory()
            with torch.cuda.stream(context.stream):
                ids = host.to(src.device, non_blocking=True)
            self._host_ids = host  # alive until the upload ran (the copy waits for it)
            self.src_ids, self.dst_ids = ids[0], ids[1]
        else:
            self.runs = plan_runs(spec.src_block_ids, spec.dst_block_ids)
            # K and V of every block of one layer (src: [layer, K|V, block, ...]).
            self._layer_bytes = 2 * len(spec.src_block_ids) * src[0, 0, 0].nbytes

    @property
    def on_cuda(self) -> bool:
        return self.context.stream is not None

    async def copy_after(self, layers: range, layer_events: Sequence[torch.cuda.Event]) -> None:
        """CUDA: copy each layer once `layer_events[layer]` completed (see the module doc)."""
        stream = self.context.stream
        if stream is None:
            raise ValueError("copy_after needs a CUDA pool")
        if len(layer_events) < layers.stop:
            raise ValueError(f"{len(layer_events)} layer events for layers up to {layers.stop}")
        launch, src_ids, dst_ids, done = self.copier.launch, self.src_ids, self.dst_ids, self._done
        with torch.cuda.stream(stream):
            for layer in layers:
                stream.wait_event(layer_events[layer])
                launch(src_ids, dst_ids, range(layer, layer + 1))
            done.record(stream)
        # The wait spans the prompt's remaining compute (up to a whole prefill step): a
        # thread blocks on the event (without the GIL) rather than the loop polling it.
        await asyncio.to_thread(done.synchronize)

    async def copy(self, layers: range) -> None:
        stream = self.context.stream
        if stream is None:
            if copies_inline(self._layer_bytes * len(layers)):
                copy_runs_inline(_as_numpy(self.src), _as_numpy(self.dst), self.runs, layers)
                return
            await asyncio.get_running_loop().run_in_executor(
                self.context.executor, copy_runs, self.src, self.dst, self.runs, layers)
            return
        done = self._done
        with torch.cuda.stream(stream):
            self.copier.launch(self.src_ids, self.dst_ids, layers)
            done.record(stream)
        await wait_event(done)


async def wait_event(event: torch.cuda.Event) -> None:
    """Return once `event` completed, without blocking the event loop."""
    spin_until = time.monotonic() + SPIN_S
    while not event.query():
        await asyncio.sleep(0 if time.monotonic() < spin_until else POLL_S)
