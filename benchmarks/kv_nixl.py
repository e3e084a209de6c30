"""The NIXL modes of benchmarks/kv_transfer.py: the same transfers posted through NIXL
(`nixl-cu12` / `nixl-cu13` from PyPI, UCX underneath; not a dependency of pdserve: install
one with `--no-deps`, since their declared dependencies pull a CUDA build of torch).

  nixl       every region of the transfer as one NIXL descriptor: each (layer, K|V, run
             of destination blocks consecutive in the pool), posted in one call (WRITE);
             done when the receiver gets the transfer's notification. This is how the
             field's transfer engines move a paged KV cache (one post per transfer, a
             completion by notification, no round trip per layer).
  raw_nixl   one descriptor for one contiguous buffer of the same size, the same way
Both are timed from the post until the receiver saw the notification, on its clock (one
host, CLOCK_MONOTONIC).

The pool is benchmarks/kv_transfer.py's (`[layer, K|V, block, slot, head, dim]`), so a
block's K (or V) of one layer is one contiguous run of `block_bytes`, and consecutive blocks
of a layer's K (or V) are adjacent.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import Any

MODES = ("nixl", "raw_nixl")


def nixl_api() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) from whichever NIXL wheel is installed."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise RuntimeError("the nixl modes need NIXL: pip install --no-deps nixl-cu12 "
                       "(or nixl-cu13 beside a CUDA 13 torch)")


def agent(name: str) -> Any:
    nixl_agent, nixl_agent_config = nixl_api()
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def runs_of(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first block, length) of each run of consecutive ids, in order; pure."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def regions(base: int, num_pool_blocks: int, block_bytes: int, num_layers: int,
            runs: Sequence[tuple[int, int]], device_id: int) -> list[tuple[int, int, int]]:
    """NIXL descriptors (address, bytes, device) of `runs` in every layer's K and V of a pool
    at `base`; pure."""
    out = []
    for layer in range(num_layers):
        for half in range(2):
            plane = base + (layer * 2 + half) * num_pool_blocks * block_bytes
            out.extend((plane + first * block_bytes, length * block_bytes, device_id)
                       for first, length in runs)
    return out


def matching_runs(dst_runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sender's source runs for `dst_runs`: its blocks 0, 1, ... cut to the same lengths,
    so the two descriptor lists pair one to one (NIXL's rule); pure."""
    out, first = [], 0
    for _, length in dst_runs:
        out.append((first, length))
        first += length
    return out


class NixlReceiver:
    """The receiving process's side: its pool (or buffer) registered, a job's descriptors
    handed to the sender, the notification awaited."""

    def __init__(self, tensor: Any, mem_type: str) -> None:
        self.agent = agent("receiver")
        self.tensor, self.mem_type = tensor, mem_type
        self.agent.register_memory(tensor)

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def descriptors(self, descs: list[tuple[int, int, int]]) -> bytes:
        return self.agent.get_serialized_descs(self.agent.get_xfer_descs(descs, self.mem_type))

    def wait(self, notification: bytes, timeout_s: float = 60.0) -> float:
        """perf_counter() when `notification` arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for messages in self.agent.get_new_notifs().values():
                if notification in messages:
                    return time.perf_counter()
        raise TimeoutError(f"no NIXL notification {notification!r} within {timeout_s:g} s")


class NixlSender:
    def __init__(self, tensor: Any, mem_type: str, receiver_metadata: bytes) -> None:
        self.agent = agent("sender")
        self.tensor, self.mem_type = tensor, mem_type
        self.agent.register_memory(tensor)
        self.remote = self.agent.add_remote_agent(receiver_metadata)

    def post(self, local: list[tuple[int, int, int]], remote: bytes, notification: bytes
             ) -> Any:
        """Post one transfer of every descriptor; its handle (poll `done`)."""
        handle = self.agent.initialize_xfer(
            "WRITE", self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.deserialize_descs(remote), self.remote, notification)
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError("NIXL refused the transfer")
        return handle

    def done(self, handle: Any) -> bool:
        state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise RuntimeError("the NIXL transfer failed")
        if state == "DONE":
            self.agent.release_xfer_handle(handle)
            return True
        return False


async def receiver_loop(mode: str, kv: Any, block_bytes: int, conn, recv) -> None:
    """The receiving process (benchmarks/kv_transfer.py's protocol, `recv` its pipe read):
    metadata out; per job, its descriptors out, then the time its notification arrived.
    `kv`: its pool (`[layer, K|V, block, ...]`), `block_bytes` one block of one layer's K."""
    receiver = NixlReceiver(kv, "VRAM" if kv.is_cuda else "DRAM")
    device_id, num_pool_blocks = kv.device.index or 0, kv.shape[2]
    conn.send(receiver.metadata)
    while (job := await recv(conn)) is not None:
        if mode == "nixl":
            descs = regions(kv.data_ptr(), num_pool_blocks, block_bytes, job["layers"],
                            runs_of(job["dst"]), device_id)
        else:
            descs = [(kv.data_ptr(), job["bytes"], device_id)]
        conn.send(receiver.descriptors(descs))
        conn.send(receiver.wait(job["request_id"].encode()))


async def measure(mode: str, kv: Any, block_bytes: int, num_layers: int, num_blocks: int,
                  metadata: bytes, conn, recv, args) -> list[float]:
    """The sending side of each transfer of `num_blocks` blocks of `num_layers` layers from
    pool `kv`: seconds from the post to the receiver's notification (warm-up transfers
    included: the caller drops them). `recv(conn)` reads the pipe."""
    import asyncio
    import random

    sender = NixlSender(kv, "VRAM" if kv.is_cuda else "DRAM", metadata)
    device_id, num_pool_blocks = kv.device.index or 0, kv.shape[2]
    runs = [list(range(s, s + args.run_blocks))
            for s in range(num_blocks, 2 * num_blocks, args.run_blocks)]
    times = []
    for i in range(args.warmup + args.repeats):
        random.shuffle(runs)
        dst = [b for run in runs for b in run][:num_blocks]
        request_id = f"j{i}"
        if mode == "nixl":
            conn.send(dict(request_id=request_id, dst=dst, layers=num_layers))
            local = regions(kv.data_ptr(), num_pool_blocks, block_bytes, num_layers,
                            matching_runs(runs_of(dst)), device_id)
        else:
            num_bytes = 2 * num_layers * num_blocks * block_bytes
            conn.send(dict(request_id=request_id, bytes=num_bytes))
            local = [(kv.data_ptr(), num_bytes, device_id)]
        remote = await recv(conn)
        started = time.perf_counter()
        handle = sender.post(local, remote, request_id.encode())
        deadline = time.monotonic() + 60.0
        while not sender.done(handle):
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL transfer {request_id} not done within 60 s")
            await asyncio.sleep(0)
        times.append(await recv(conn) - started)
    return times
