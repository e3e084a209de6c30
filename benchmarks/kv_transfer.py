"""KV-transfer throughput between two processes: this backend vs the raw paths under it.

For each transfer size, with a Llama-3-8B-like pool (32 layers, 8 KV heads, head dim 128,
16-token blocks, bf16: 32 KiB per block per layer for K and again for V), it reports GB/s
(median of --repeats) of each mode (benchmarks/kv_modes.py says what each one times).
Destination blocks are fragmented into runs of --run-blocks (what a paged cache looks like).

    python -m benchmarks.kv_transfer --device cpu
    python -m benchmarks.kv_transfer --device cuda --max-mib 1024   # cuda_ipc on one GPU
    python -m benchmarks.kv_transfer --device cuda --check           # correctness, 2 processes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from typing import Any

from benchmarks import kv_nixl
from benchmarks.kv_modes import RAW_MODES, backend_of, split_mode

LAYOUT = dict(dtype="bfloat16", num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)
BLOCK_LAYER_BYTES = 2 * 16 * 8 * 128 * 2  # K and V of one block in one layer


def _sizes(max_mib: int) -> list[tuple[int, int]]:
    """(num_layers, num_blocks) per size: 1 MiB uses 16 layers of 1 block, then 32 layers."""
    out, mib = [(16, 1)], 2
    while mib <= max_mib:
        if mib >= 16:
            out.append((32, mib // 2))
        mib *= 4 if mib >= 16 else 8
    return out


def _storage(num_blocks: int, device: str, seed: int | None):
    import torch

    from engine.kv_storage import KVLayout, KVStorage
    storage = KVStorage(KVLayout(num_blocks=num_blocks, **LAYOUT), device)
    if seed is not None:  # the receiver's pool is touched by KVStorage's zeros()
        storage.kv.view(torch.int16).random_()
    return storage


def _flat(num_bytes: int, device: str):
    import torch
    t = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    return t if device == "cuda" else t.numpy()


def _filled(num_bytes: int, device: str):
    buffer = _flat(num_bytes, device)
    buffer[:] = 1  # first touch here, not inside the timed copy
    return buffer


async def _pipe_recv(conn, peer=None) -> Any:
    """The next message on `conn`; raises if the `peer` process died before sending it."""
    def recv() -> Any:
        while peer is not None and not conn.poll(0.5):
            if not peer.is_alive():
                raise RuntimeError(f"the receiver process exited ({peer.exitcode})")
        return conn.recv()
    return await asyncio.get_running_loop().run_in_executor(None, recv)


def receiver_main(mode: str, device: str, num_blocks: int, transports: str | None, conn):
    import uvloop
    uvloop.run(_receiver_loop(mode, device, num_blocks, transports, conn))


async def _receiver_loop(mode, device, num_blocks, transports, conn) -> None:
    if mode in kv_nixl.MODES:
        await kv_nixl.receiver_loop(mode, _storage(num_blocks, device, None).kv,
                                    BLOCK_LAYER_BYTES // 2, conn, _pipe_recv)
    elif split_mode(mode)[0] or mode in ("check", "check_mapped"):
        import torch

        from kv_transfer.backend import make_receiver
        worker, (backend, mapping) = None, backend_of(mode, device)
        if backend == "ucx":
            from kv_transfer.ucx import UcxWorker
            worker = UcxWorker(transports=transports)
        storage = _storage(num_blocks, device, None)
        receiver = await make_receiver(storage, backend, ucx_worker=worker, mapping=mapping)
        conn.send(receiver.address)
        while (job := await _pipe_recv(conn)) is not None:
            if mode.startswith("check"):  # re-poisoned per job: what is not written stays so
                storage.kv.view(torch.int16).fill_(POISON)
            handle = receiver.expect(job["request_id"], job["dst"], range(job["layers"]),
                                     lambda ids: None, 60.0)
            conn.send("ready")
            await handle.wait()
            if mode.startswith("check"):
                conn.send(_check_pool(storage.kv, job))
            else:
                conn.send(time.perf_counter())  # CLOCK_MONOTONIC: the sender's clock too
        await receiver.close()
    elif mode.startswith("raw_ucx"):
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        from kv_transfer.ucx import UcxWorker
        worker = UcxWorker(transports=transports)
        conn.send(worker.address_bytes)
        tag, buffer = 1, None
        while (num_bytes := await _pipe_recv(conn)) is not None:
            if buffer is None:  # one buffer, touched once: page faults are not the path
                buffer = _filled(num_bytes, device)
            request = worker.ctx.worker.tag_recv(Array(buffer), Tag(tag))
            conn.send("ready")
            await request.wait()
            conn.send(time.perf_counter())
            tag += 1
    else:  # raw_tcp
        loop = asyncio.get_running_loop()
        state: dict[str, Any] = {}

        class Sink(asyncio.BufferedProtocol):
            def get_buffer(self, sizehint):
                if "view" not in state or state["pos"] == len(state["view"]):
                    return memoryview(bytearray(1))  # nothing expected: nothing arrives
                return state["view"][state["pos"]:]

            def buffer_updated(self, nbytes):
                state["pos"] += nbytes
                if state["pos"] == len(state["view"]):
                    state["done"].set_result(None)

        server = await loop.create_server(Sink, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        sink = None
        while (num_bytes := await _pipe_recv(conn)) is not None:
            sink = sink if sink is not None else memoryview(_filled(num_bytes, "cpu"))
            state.update(view=sink, pos=0, done=loop.create_future())
            conn.send("ready")
            await state["done"]
            conn.send("done")
        server.close()


POISON = 0x5A5A  # the check's receiver pool, as int16: blocks not written must keep it


def _pattern(num_elements: int):
    """Deterministic int16 contents of the check's sender pool (no RNG: both sides make it)."""
    import torch
    return ((torch.arange(num_elements, dtype=torch.int64) * 7919) % 65521 - 32760) \
        .to(torch.int16)


async def _check(args, mode: str) -> dict:
    """Transfers of fragmented, non-contiguous blocks between two processes: over UCX
    (mode "check") or mapped ("check_mapped")."""
    import torch

    from kv_transfer.backend import make_sender
    from kv_transfer.interface import TransferSpec
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    pool_blocks, num_layers = 96, LAYOUT["num_layers"]
    proc = ctx.Process(target=receiver_main, args=(mode, args.device, pool_blocks,
                                                   args.transports, child))
    proc.start()
    try:
        address = await _pipe_recv(parent, proc)
        storage = _storage(pool_blocks, args.device, None)
        storage.kv.view(torch.int16).copy_(_pattern(storage.kv.numel()).view(storage.kv.shape))
        backend, mapping = backend_of(mode, args.device)
        worker = None
        if backend == "ucx":
            from kv_transfer.ucx import UcxWorker
            worker = UcxWorker(transports=args.transports)
        sender = make_sender(storage, backend, ucx_worker=worker, mapping=mapping)
        src = [3, 4, 5, 17, 40, 41, 9, 60, 61, 62, 63, 2]
        dst = [70, 71, 72, 8, 50, 51, 33, 10, 11, 12, 13, 90]
        results = []
        for i, layers in enumerate((num_layers, 1)):  # every layer; then one (a small message)
            job = dict(request_id=f"check{i}", src=src, dst=dst, layers=layers)
            parent.send(job)
            await _pipe_recv(parent, proc)
            handle = await sender.start(address, TransferSpec(
                request_id=job["request_id"], src_block_ids=src, dst_block_ids=dst,
                layer_begin=0, layer_end=layers), 60.0)
            for layer in reversed(range(layers)):  # any order is allowed
                handle.send_layer(layer)
            await handle.finish()
            results.append(dict(await _pipe_recv(parent, proc), packing=str(handle.plan.packing)
                                if hasattr(handle.plan, "packing") else None,
                                mapped=handle.mapped))
        await sender.close()
        parent.send(None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    ok = all(r["bitwise_equal"] and r["poison_untouched"] and
             r["mapped"] == (mode == "check_mapped") for r in results)
    return dict(mode=mode, device=args.device, transports=args.transports, ok=ok,
                transfers=results)


def _check_pool(kv, job: dict) -> dict:
    """Destination blocks equal the sender's seeded pool; every other byte still poison."""
    import torch
    expected = _pattern(kv.numel()).view(kv.shape)
    got = kv.view(torch.int16).cpu()
    layers = range(job["layers"])
    equal = all(torch.equal(got[:len(layers), :, d], expected[:len(layers), :, s])
                for s, d in zip(job["src"], job["dst"]))
    touched = torch.zeros(got.shape[:3], dtype=torch.bool)
    touched[:len(layers), :, job["dst"]] = True
    untouched_ok = bool((got[~touched] == POISON).all())
    return dict(bitwise_equal=equal, poison_untouched=untouched_ok,
                num_blocks=len(job["dst"]), num_layers=len(layers))


async def _measure(mode: str, device: str, num_layers: int, num_blocks: int, args) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    pool_blocks = 2 * num_blocks + 8
    proc = ctx.Process(target=receiver_main, args=(mode, device, pool_blocks,
                                                   args.transports, child))
    proc.start()
    address = await _pipe_recv(parent, proc)
    num_bytes = num_layers * num_blocks * BLOCK_LAYER_BYTES
    times = []
    try:
        base, timing = split_mode(mode)
        if mode in kv_nixl.MODES:
            times = await kv_nixl.measure(
                mode, _storage(pool_blocks, device, 0).kv, BLOCK_LAYER_BYTES // 2, num_layers,
                num_blocks, address, parent, lambda conn: _pipe_recv(conn, proc), args)
        elif base:
            from kv_transfer.backend import make_sender
            from kv_transfer.interface import TransferSpec
            from kv_transfer.packing import PackingLimits
            worker, (backend, mapping) = None, backend_of(mode, device)
            if backend == "ucx":
                from kv_transfer.ucx import UcxWorker
                worker = UcxWorker(transports=args.transports)
            limits = PackingLimits.for_device(device == "cuda")
            if base.endswith("_per_run"):
                limits = PackingLimits(slot_bytes=limits.slot_bytes, num_slots=limits.num_slots,
                                       min_message_bytes=0, pack_below_run_bytes=0)
            sender = make_sender(_storage(pool_blocks, device, 0), backend, ucx_worker=worker,
                                 limits=limits, mapping=mapping)
            runs = [list(range(s, s + args.run_blocks))
                    for s in range(num_blocks, 2 * num_blocks, args.run_blocks)]
            for i in range(args.warmup + args.repeats):
                random.shuffle(runs)
                dst = [b for run in runs for b in run][:num_blocks]
                parent.send(dict(request_id=f"r{i}", dst=dst, layers=num_layers))
                await _pipe_recv(parent, proc)
                started = time.perf_counter()
                spec = TransferSpec(request_id=f"r{i}", src_block_ids=list(range(num_blocks)),
                                    dst_block_ids=dst, layer_begin=0, layer_end=num_layers)
                handle = await sender.start(address, spec, 60.0)
                if handle.mapped != mapping:
                    raise RuntimeError(f"{mode}: the transfer was {'' if handle.mapped else 'not '}"
                                       "mapped")
                if timing != "all":
                    started = time.perf_counter()
                for layer in range(num_layers):
                    handle.send_layer(layer)
                await handle.finish()
                finished = time.perf_counter()
                landed = await _pipe_recv(parent, proc)
                times.append((landed if timing == "recv" else finished) - started)
            await sender.close()
        elif mode.startswith("raw_ucx"):
            from kv_transfer.ucx import UcxWorker
            worker = UcxWorker(transports=args.transports)
            endpoint = await worker.endpoint_to(address)
            src = _filled(num_bytes, device)
            for i in range(args.warmup + args.repeats):
                parent.send(num_bytes)
                await _pipe_recv(parent, proc)
                started = time.perf_counter()
                await endpoint.send(src, tag=i + 1, force_tag=True)
                finished = time.perf_counter()
                landed = await _pipe_recv(parent, proc)
                times.append((landed if mode == "raw_ucx_recv" else finished) - started)
            endpoint.abort(period=10**8)
        else:
            _, writer = await asyncio.open_connection("127.0.0.1", address)
            src = memoryview(_filled(num_bytes, "cpu"))
            for i in range(args.warmup + args.repeats):
                parent.send(num_bytes)
                await _pipe_recv(parent, proc)
                started = time.perf_counter()
                writer.write(src)
                await writer.drain()
                await _pipe_recv(parent, proc)
                times.append(time.perf_counter() - started)
            writer.close()
        parent.send(None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return num_bytes / statistics.median(times[args.warmup:]) / 1e9


def _copy_gbps(num_bytes: int, device: str, args) -> float:
    import numpy as np
    import torch
    src, dst = _filled(num_bytes, device), _filled(num_bytes, device)
    times = []
    for _ in range(args.warmup + args.repeats):
        started = time.perf_counter()
        if device == "cuda":
            dst.copy_(src)
            torch.cuda.synchronize()
        else:
            np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return num_bytes / statistics.median(times[args.warmup:]) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both pools live (default cpu)")
    parser.add_argument("--max-mib", type=int, default=256,
                        help="largest transfer in MiB; the sizes are 1 MiB, then 16 MiB up "
                             "by 4x (default 256)")
    parser.add_argument("--modes", default=None,
                        help="comma list of ucx, ucx_per_run, tcp, tcp_per_run, mapped, each "
                             "also as MODE_data and MODE_recv (e.g. ucx_data; benchmarks/"
                             "kv_modes.py says how each is timed), raw_ucx, raw_ucx_recv, raw_tcp, "
                             "copy, and with NIXL installed nixl, raw_nixl (benchmarks/kv_nixl.py; "
                             "default: all that apply to the device, without NIXL's)")
    parser.add_argument("--transports", default=None, help="UCX_TLS for both processes")
    parser.add_argument("--run-blocks", type=int, default=4,
                        help="destination blocks per contiguous run (the fragmentation; "
                             "default 4)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed transfers per mode and size (default 2)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed transfers per mode and size; the median is "
                             "reported (default 5)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--check", action="store_true",
                        help="only check correctness (bitwise, poison untouched), over UCX and "
                             "mapped; exit 1 if either fails")
    args = parser.parse_args(argv)
    if args.check:
        checks = [asyncio.run(_check(args, mode)) for mode in ("check", "check_mapped")]
        result = dict(ok=all(c["ok"] for c in checks), checks=checks)
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0 if result["ok"] else 1
    default = ("ucx,mapped,mapped_data,mapped_recv,raw_ucx,raw_ucx_recv,copy"
               if args.device == "cuda" else "ucx,ucx_per_run,tcp,tcp_per_run,mapped,mapped_data,"
                                             "mapped_recv,raw_ucx,raw_ucx_recv,raw_tcp,copy")
    modes = (args.modes or default).split(",")
    import uvloop  # both processes run the event loop a worker runs
    unknown = [m for m in modes if not split_mode(m)[0] and m not in RAW_MODES + kv_nixl.MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; see --help")
    rows = []
    print(f"{'size':>9} " + " ".join(f"{m:>8}" for m in modes) + "   (GB/s)")
    for num_layers, num_blocks in _sizes(args.max_mib):
        num_bytes = num_layers * num_blocks * BLOCK_LAYER_BYTES
        row = {"bytes": num_bytes}
        for mode in modes:
            row[mode] = (_copy_gbps(num_bytes, args.device, args) if mode == "copy" else
                         uvloop.run(_measure(mode, args.device, num_layers, num_blocks, args)))
        rows.append(row)
        print(f"{num_bytes / 2**20:>7.0f}Mi " + " ".join(f"{row[m]:>8.2f}" for m in modes),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
