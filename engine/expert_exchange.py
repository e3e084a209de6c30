"""Expert parallelism's exchange: rank 0 runs the whole model but the experts it does not
hold; the other ranks (expert ranks) hold experts only, and compute them for rank 0.

    rank 0 (attention, dense layers, shared experts, KV)      expert rank k (experts only)
      MoE block b, tokens x [T, H]:
        header (INPUT, b, T)  ───────── broadcast ─────────▶  which block, how many tokens
        x                     ───────── broadcast ─────────▶  x
        routed_0 = its experts' rows                          routed_k = its experts' rows
        routed = sum over ranks ◀────── all-reduce ────────▶  (its copy of the sum dropped)
      new placements: header (PLACE, 0, 0) + msgpack bytes    switch, then go on waiting
      end:            header (STOP, 0, 0)                     exit

Every (token, expert) pair is computed by exactly one rank (engine/expert_parallel.py's
placements), so the sum is the unsharded block's routed output; the router is replicated
and every rank routes the same x alike. Because attention and the KV cache live on rank 0
alone, the KV pool of an expert-parallel worker is an ordinary one: a prefill group hands
its KV to a decode worker of any expert-parallel size, as a single process does.

Each header says what follows, so the expert ranks need no schedule: whatever runs the
model on rank 0 (a step, a split mixed step, warm-up) is mirrored block by block.

Invariants: rank 0 sends a header before every broadcast it makes and every rank takes part
in every collective in the same order; an expert rank computes nothing but the routed
experts of the blocks it is sent.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from engine.byte_broadcast import ByteBroadcast
from engine.expert_parallel import ExpertBank, ExpertParallelRank, initial_placements, moe_blocks
from engine.expert_placement import ExpertPlacement
from engine.models.moe import MoEBlock
from engine.tensor_parallel_sharding import check_shardable

if TYPE_CHECKING:
    from engine.models.decoder import DecoderForCausalLM


class Op(enum.IntEnum):
    INPUT = 1  # a block's tokens follow
    PLACE = 2  # new placements follow (msgpack bytes)
    STOP = 3  # the group ends


class ExpertExchange:
    """Rank 0's side: set on each of its MoE blocks (`MoEBlock.exchange`). `device` is
    where the collectives' tensors live (CPU for gloo, rank 0's GPU for nccl)."""

    def __init__(self, blocks: Sequence[MoEBlock], device: torch.device) -> None:
        self.device = device
        self._bytes = ByteBroadcast(device)
        self.block_index = {id(block): b for b, block in enumerate(blocks)}
        self.stopped = False

    def _header(self, op: Op, index: int, size: int) -> None:
        dist.broadcast(torch.tensor([op, index, size], dtype=torch.int64, device=self.device), 0)

    def share(self, block: MoEBlock, x: torch.Tensor) -> None:
        """Send block `block`'s input tokens to the expert ranks."""
        if self.stopped:
            raise RuntimeError("the expert-parallel group has been shut down")
        self._header(Op.INPUT, self.block_index[id(block)], x.shape[0])
        dist.broadcast(x.contiguous(), 0)

    @staticmethod
    def combine(routed: torch.Tensor) -> torch.Tensor:
        """The sum over every rank of the routed outputs (in place); returns it."""
        dist.all_reduce(routed)
        return routed

    def send_placements(self, placements: Sequence[ExpertPlacement]) -> None:
        self._header(Op.PLACE, 0, 0)
        self._bytes.send(msgspec.msgpack.encode(tuple(placements)))

    def stop(self) -> None:
        """Tell the expert ranks to exit; idempotent."""
        if not self.stopped:
            self.stopped = True
            self._header(Op.STOP, 0, 0)


def serve_experts(blocks: Sequence[MoEBlock], device: torch.device, hidden_size: int,
                  dtype: torch.dtype,
                  place: Callable[[tuple[ExpertPlacement, ...]], None]) -> int:
    """An expert rank's loop: compute each block it is sent until told to stop; `place`
    switches its experts to new placements. Returns the number of blocks computed."""
    header = torch.empty(3, dtype=torch.int64, device=device)
    placements = ByteBroadcast(device)
    decoder = msgspec.msgpack.Decoder(tuple[ExpertPlacement, ...])
    num_computed = 0
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0)
            op, index, size = header.tolist()
            if op == Op.STOP:
                return num_computed
            if op == Op.PLACE:
                place(decoder.decode(placements.receive()))
                continue
            if op != Op.INPUT or not 0 <= index < len(blocks):
                raise RuntimeError(f"expert rank: unexpected header {op, index, size}")
            x = torch.empty(size, hidden_size, dtype=dtype, device=device)
            dist.broadcast(x, 0)
            dist.all_reduce(blocks[index].routed(x))
            num_computed += 1


def expert_rank_blocks(full: "DecoderForCausalLM", rank: int, num_ranks: int,
                       device: torch.device | str
                       ) -> tuple[torch.nn.ModuleList, ExpertParallelRank]:
    """Expert rank `rank`'s part of `full`: its MoE blocks, holding the experts the initial
    placements give it (no shared expert: rank 0 runs those), on `device`; and the rank's
    state for later placements."""
    own = moe_blocks(full)
    state = ExpertParallelRank(rank, ExpertBank.of(full), device)
    for block in own:
        block.shared_expert = block.shared_expert_gate = None
    blocks = torch.nn.ModuleList(own)
    state.place(blocks, initial_placements(blocks, num_ranks))
    return blocks.to(device).eval(), state


def serve_expert_rank(model: str, rank: int, num_ranks: int, dtype: torch.dtype,
                      device: torch.device) -> int:
    """Expert rank `rank` of a connected group: load its experts of `model`, then serve rank
    0's MoE blocks until told to stop. Returns the number of blocks computed."""
    from engine.loader import load_model

    full = load_model(model, dtype=dtype, device="cpu").model
    check_shardable(full.config, num_ranks, expert_parallel=True)
    full_hidden_size = full.config.hidden_size
    blocks, state = expert_rank_blocks(full, rank, num_ranks, device)
    del full  # the bank keeps the experts' weights; the rest of the model goes
    return serve_experts(moe_blocks(blocks), device, full_hidden_size, dtype,
                         lambda placements: state.place(blocks, placements))
