"""The host KV tier's copy rates: blocks offloaded to and reloaded from the tier, against one
plain copy of the same bytes (pinned host -> device on CUDA, a memcpy on the CPU).

An offload at eviction copies one block per call (every layer's K and V of one block);
blocks freed together (a released request's, offered ahead of eviction) are queued and
copied in one call, as is a reload of a whole prefix: a gather or scatter through a staging
buffer, engine/host_copier.py. The plain copy moves the same bytes as one contiguous
tensor, the ceiling. The issue's target is a reload rate of at least 80% of it.

    python -m benchmarks.host_kv_tier --device cuda            # Llama-3-8B's KV shape, bf16
    python -m benchmarks.host_kv_tier --device cpu --dtype float32 --blocks 64

Output: one markdown table on stdout (medians of --repeats runs, each synced at its end).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.kv_storage import KVLayout, KVStorage


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    run()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the pool's device (default: cuda where there is one)")
    parser.add_argument("--dtype", default="bfloat16", help="the KV cache's dtype",
                        choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per run")
    parser.add_argument("--layers", type=int, default=32, help="model layers (Llama-3-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (Llama-3-8B: 128)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each copy")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    n = args.blocks
    layout = KVLayout(dtype=args.dtype, num_layers=args.layers, num_blocks=2 * n,
                      block_size=args.block_size, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim)
    storage = KVStorage(layout, device)
    storage.kv.normal_()
    block_bytes = 2 * layout.num_layers * layout.block_bytes
    tier = storage.host_tier(n * block_bytes)
    assert tier is not None and tier.num_host_blocks == n
    runs = iter(range(1 << 62))
    held: list[int] = []  # the hashes of the last offload: what the tier holds

    def offload() -> None:  # n fresh hashes each run: every offer copies
        base = next(runs) * n
        held[:] = [base + i for i in range(n)]
        for i, block_hash in enumerate(held):
            tier.offer(block_hash, i)

    def offload_ahead() -> None:  # the same blocks freed together: queued, then one call
        base = next(runs) * n
        held[:] = [base + i for i in range(n)]
        for i, block_hash in enumerate(held):
            tier.offer_ahead(block_hash, i)
        tier.flush()

    def reload() -> None:
        tier.pin(held)
        tier.reload(held, [n + i for i in range(n)])  # one prefix: one call, as at admission

    pinned = device.type == "cuda"
    host = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(n * block_bytes, dtype=torch.uint8, device=device)
    rows = [("plain copy to the device", _median_s(
                lambda: dev.copy_(host, non_blocking=True), device, args.repeats)),
            ("plain copy to the host", _median_s(
                lambda: host.copy_(dev, non_blocking=True), device, args.repeats)),
            ("tier offload at eviction (one call a block)",
             _median_s(offload, device, args.repeats)),
            ("tier offload ahead (queued, one call)",
             _median_s(offload_ahead, device, args.repeats)),
            ("tier reload (one call, one copy a block)", _median_s(reload, device, args.repeats))]
    assert torch.equal(storage.kv[:, :, n:], storage.kv[:, :, :n])  # reloads are exact
    total = n * block_bytes
    print(f"{n} blocks of {block_bytes / 2**20:.2f} MiB ({total / 2**30:.2f} GiB), "
          f"{args.dtype}, {device}")
    print("| copy | GB/s | of the plain copy that way |")
    print("|---|---|---|")
    for name, seconds in rows:
        plain = rows[0][1] if "device" in name or "reload" in name else rows[1][1]
        print(f"| {name} | {total / seconds / 1e9:.1f} | {plain / seconds:.0%} |")


if __name__ == "__main__":
    main()
