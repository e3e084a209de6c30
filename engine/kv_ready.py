"""KVReady: the step that writes a request's last prompt K/V is queued; say so, per layer.

A prefill-only request added with `notify_kv_ready=True` gets one KVReady, from the step
that computes its final prompt chunk, before that step's sampling waits for the model:

    step N:  schedule ─▶ [CPU: KVReady(events=None)] ─▶ model queued ─▶ [CUDA: KVReady(events)]
             ─▶ sample (waits) ─▶ RequestOutput(first token, prefilled)

so whoever sends the KV elsewhere (worker/prefill_half.py) can announce the transfer
while the prompt computes and, on CUDA, queue each layer's copy behind that layer's event:
the copy of layer n overlaps the compute of layers n+1..L-1.

`layer_events[n]` (CUDA only) completes once layer n's K and V of every token of this
step are written, on the stream the model ran on. With `layer_events=None` the K/V is
written when the step's RequestOutput for the request arrives (the host runs the model
synchronously; or the runner cannot record events, as under tensor parallelism).

Invariants: at most one KVReady per request; its block table covers the whole prompt
(`len(block_ids) * block_size >= num_prompt_tokens`); the blocks stay the request's while
it is PREFILLED, until it is released or aborted. A request that ends at its first token
(EOS, one token asked for) frees them with that step: a copy queued from them may then
read blocks that later steps rewrite, so its transfer must be cancelled, not completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.schedule_output import ScheduledChunk


@dataclass(frozen=True, slots=True)
class KVReady:
    request_id: str
    block_ids: tuple[int, ...]  # the request's block table: prompt block i is block_ids[i]
    num_prompt_tokens: int
    layer_events: tuple[torch.cuda.Event, ...] | None

    def check_invariants(self, block_size: int, num_layers: int) -> None:
        if len(self.block_ids) * block_size < self.num_prompt_tokens:
            raise AssertionError(f"KVReady of {self.request_id}: {len(self.block_ids)} blocks "
                                 f"do not cover {self.num_prompt_tokens} prompt tokens")
        if self.layer_events is not None and len(self.layer_events) != num_layers:
            raise AssertionError(f"KVReady of {self.request_id}: {len(self.layer_events)} "
                                 f"layer events for {num_layers} layers")


class LayerEventRecorder:
    """The model's per-layer hook for one step: records one CUDA event after each layer."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def __call__(self, layer: int) -> None:
        if layer != len(self.events):
            raise AssertionError(f"layer {layer} finished out of order "
                                 f"(expected {len(self.events)})")
        event = torch.cuda.Event()
        event.record()  # on the current stream: the one the layer's kernels ran on
        self.events.append(event)


def announce_kv_ready(chunks: Sequence[ScheduledChunk], num_prompt_tokens: Callable[[str], int],
                      events: tuple[torch.cuda.Event, ...] | None,
                      on_kv_ready: Callable[[KVReady], None], block_size: int,
                      num_layers: int) -> None:
    """Hand `on_kv_ready` the KVReady of each final prompt chunk in `chunks` (one per
    request, `num_prompt_tokens` giving its prompt's length), with the step's layer events."""
    for chunk in chunks:
        ready = KVReady(chunk.request_id, chunk.block_ids, num_prompt_tokens(chunk.request_id),
                        events)
        if __debug__:
            ready.check_invariants(block_size, num_layers)
        on_kv_ready(ready)
