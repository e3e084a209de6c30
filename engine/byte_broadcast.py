"""Bytes from rank 0 to every rank of a process group, over tensor broadcasts: the length
first, then the bytes as a uint8 tensor. The group's messages are msgspec-encoded, never
pickles (engine/tensor_parallel_group.py's steps, engine/expert_exchange.py's placements).
Every rank calls `send` (rank 0) or `receive` (the others) in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ByteBroadcast:
    """`device` is where the collectives' tensors live (CPU for gloo, the rank's GPU for
    nccl)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def send(self, payload: bytes) -> None:
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.device), 0)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        dist.broadcast(data, 0)

    def receive(self) -> bytes:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, 0)
        return data.cpu().numpy().tobytes()
