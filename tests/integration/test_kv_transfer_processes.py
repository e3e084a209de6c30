"""KV transfer between real processes on loopback: the UCX and TCP carriers, and mapped
transfers (the sender copies into the receiver's pool, mapped from its memfd on the host or
by CUDA IPC on a GPU; the carrier idle).

KV_TEST_DEVICE=cuda runs the peers' pools on the GPU (use with `-k mapped` on a GPU host).

This file is also the peer program: `python test_kv_transfer_processes.py ROLE CONFIG_JSON`
runs a receiver or a sender and reports one JSON line per event on stdout. The sender's
pool is random from a seed, so the receiver can check bytes without shipping them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = dict(dtype="bfloat16", num_layers=4, num_blocks=64, block_size=16,
              num_kv_heads=2, head_dim=32)
BACKENDS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("ucxx") is None, reason="ucxx not installed")),
    "mapped"]
DEVICE = os.environ.get("KV_TEST_DEVICE", "cpu")


def _carrier(cfg: dict) -> tuple[str, bool]:
    """(carrier backend, mapping on) of a peer's config; the TCP carrier takes host pools
    only, so mapped GPU peers keep UCX as their (idle) carrier."""
    if cfg["backend"] == "mapped":
        return ("ucx" if DEVICE == "cuda" else "tcp"), True
    return cfg["backend"], False


# ---------------------------------------------------------------------------- peer program
def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def _pool(layout_fields: dict, seed: int | None):
    import torch

    from engine.kv_storage import KVLayout, KVStorage
    storage = KVStorage(KVLayout(**layout_fields), DEVICE)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        words = storage.kv.view(torch.int16)
        words.copy_(torch.randint(-2**15, 2**15, words.shape, dtype=torch.int16, generator=g))
    return storage


async def _gate(cfg: dict) -> str:
    """Wait for the test's "go" line, so deadlines start after both processes are up; a
    sender's line carries the receiver's address (the peers start at once, so a sender
    learns it only then). Returns what follows "go"."""
    if not cfg.get("gate"):
        return ""
    _emit(event="gated")
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.removeprefix("go").strip()


async def _compute_layer(handle, delay_s: float) -> None:
    """The sender "computing" its next layer for `delay_s`, cut short once the transfer
    failed: a prefill worker checks between layers, and the test need not wait it out."""
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline and not handle.state.is_terminal:
        await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())))


def _resources() -> dict:
    """What a leak would grow. Tasks: all but the UCX worker's progress task, which exists
    only until 20 ms after its last activity (kv_transfer/ucx_progress.py, "ucx-arm")."""
    with open("/proc/self/maps") as f:
        num_maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return dict(num_maps=num_maps, rss_kb=rss_kb, num_fds=len(os.listdir("/proc/self/fd")),
                num_tasks=sum(1 for t in asyncio.all_tasks() if t.get_name() != "ucx-arm"))


async def _run_receiver(cfg: dict) -> None:
    import torch

    from kv_transfer.backend import make_receiver
    storage = _pool(cfg.get("layout", LAYOUT), None)
    backend, mapping = _carrier(cfg)
    if cfg.get("refuse_receive"):
        _refuse_receive(cfg["refuse_receive"])
    receiver = await make_receiver(storage, backend, token=cfg.get("token", ""),
                                   abort_timeout_s=0.5, mapping=mapping)
    _emit(event="address", address=receiver.address)
    transfers = cfg["transfers"]
    releases: dict[str, int] = {}

    async def one(t: dict) -> None:
        rid = t["request_id"]
        releases[rid] = 0

        def release(ids: list[int]) -> None:
            assert ids == t["dst"]
            releases[rid] += 1
        started = time.monotonic()
        handle = receiver.expect(rid, t["dst"], range(*t["layers"]), release, t["timeout_s"])
        try:
            await handle.wait()
            outcome = "ok"
        except Exception as exc:
            outcome = type(exc).__name__
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.05)  # a second release would show up here
        result = dict(event="done", request_id=rid, outcome=outcome, elapsed_s=elapsed,
                      releases=releases[rid], state=handle.state.value)
        if outcome == "ok" and "src_seed" in t:
            src = _pool(cfg.get("layout", LAYOUT), t["src_seed"]).kv
            a, b = range(*t["layers"]), storage.kv
            result["bitwise"] = all(
                torch.equal(src[a.start:a.stop, :, s].view(torch.int16),
                            b[a.start:a.stop, :, d].view(torch.int16))
                for s, d in zip(t["src"], t["dst"]))
        result["pool_nonzero"] = int(torch.count_nonzero(storage.kv.view(torch.int16)))
        _emit(**result)

    if cfg.get("loop"):
        await _receive_loop(receiver, cfg["loop"])
    else:
        await _gate(cfg)

        async def expecting() -> None:  # runs after every one() registered its expect()
            _emit(event="expecting")
        await asyncio.gather(*(one(t) for t in transfers), expecting())
    receiver.check_invariants()
    _emit(event="stats", num_sessions=receiver.num_sessions, num_expected=receiver.num_expected,
          num_tasks=receiver.num_tasks, num_posted=getattr(receiver.carrier, "num_posted", 0)
          if hasattr(receiver.carrier, "num_posted") else receiver.carrier.num_registered)
    await asyncio.sleep(cfg.get("linger_s", 0.5))
    await receiver.close()


def _refuse_receive(n: int) -> None:
    """Fault injection: UCX refuses this process's n-th receive buffer (once)."""
    from kv_transfer import ucx
    real, made = ucx.Array, [0]

    def array(view):
        made[0] += 1
        if made[0] == n:
            raise RuntimeError("injected: UCX refused a receive")
        return real(view)
    ucx.Array = array


async def _receive_loop(receiver, loop_cfg: dict) -> None:
    n, window, dst = loop_cfg["count"], 8, loop_cfg["dst"]
    handles = {}
    for i in range(min(window, n)):
        handles[i] = receiver.expect(f"loop-{i}", dst, range(0, 4), lambda ids: None, 30.0)
    for i in range(n):
        await handles.pop(i).wait()
        if i + window < n:
            handles[i + window] = receiver.expect(f"loop-{i + window}", dst, range(0, 4),
                                                  lambda ids: None, 30.0)
        if i + 1 in (100, n):
            _emit(event="checkpoint", i=i + 1, **_resources(),
                  num_sessions=receiver.num_sessions, num_receiver_tasks=receiver.num_tasks)


async def _start_when_expected(sender, peer: str, spec):
    """start(), asked again (bounded) while the receiver's loop has not expected `spec` yet:
    the loop expects 8 transfers ahead, and on a loaded host its task may lag behind."""
    from kv_transfer.errors import TransferRejected
    for _ in range(200):
        try:
            return await sender.start(peer, spec, 30.0)
        except TransferRejected as exc:
            if "not expected" not in str(exc):
                raise
            await asyncio.sleep(0.01)
    return await sender.start(peer, spec, 30.0)


async def _run_sender(cfg: dict) -> None:
    from kv_transfer.backend import make_sender
    from kv_transfer.interface import TransferSpec
    storage = _pool(cfg.get("layout", LAYOUT), cfg["seed"])
    from kv_transfer.packing import PackingLimits

    # Packed unless asked otherwise: the path CUDA pools always take, so the failure tests
    # (kills, deadlines, 1,000 transfers) exercise staging slots on the CPU too.
    host = PackingLimits.for_device(False)
    limits = PackingLimits(slot_bytes=host.slot_bytes, num_slots=host.num_slots,
                           min_message_bytes=host.min_message_bytes, pack_below_run_bytes=1 << 62)
    if cfg.get("unpacked"):  # one zero-copy message per run, whatever the run size
        limits = PackingLimits(slot_bytes=limits.slot_bytes, num_slots=limits.num_slots,
                               min_message_bytes=0, pack_below_run_bytes=0)
    backend, mapping = _carrier(cfg)
    sender = make_sender(storage, backend, token=cfg.get("token", ""),
                         abort_timeout_s=0.5, limits=limits, mapping=mapping)
    peer = await _gate(cfg)
    if cfg.get("loop"):
        n, src, dst = cfg["loop"]["count"], cfg["loop"]["src"], cfg["loop"]["dst"]
        for i in range(n):
            spec = TransferSpec(request_id=f"loop-{i}", src_block_ids=src, dst_block_ids=dst,
                                layer_begin=0, layer_end=4)
            handle = await _start_when_expected(sender, peer, spec)
            for layer in range(4):
                handle.send_layer(layer)
            await handle.finish()
            if i + 1 in (100, n):
                _emit(event="checkpoint", i=i + 1, **_resources(), num_links=sender.num_links,
                      num_sender_tasks=sender.num_tasks, num_mapped=sender.num_mapped,
                      num_endpoints=getattr(sender.carrier, "num_endpoints", 0))
        await sender.close()
        return

    async def one(t: dict) -> None:
        spec = TransferSpec(request_id=t["request_id"], src_block_ids=t["src"],
                            dst_block_ids=t["dst"], layer_begin=t["layers"][0],
                            layer_end=t["layers"][1])
        started = time.monotonic()
        try:
            handle = await sender.start(peer, spec, t["timeout_s"])
            for layer in range(*t["layers"]):
                handle.send_layer(layer)
                _emit(event="sent_layer", request_id=t["request_id"], layer=layer)
                await _compute_layer(handle, t.get("layer_delay_s", 0.0))
                if handle.state.is_terminal:
                    break  # a prefill worker stops sending once the transfer failed
            await handle.finish()
            outcome, error = "ok", ""
        except Exception as exc:
            outcome, error = type(exc).__name__, str(exc)
        _emit(event="done", request_id=t["request_id"], outcome=outcome, error=error,
              elapsed_s=time.monotonic() - started, mapped=sender.num_mapped)
    await asyncio.gather(*(one(t) for t in cfg["transfers"]))
    await sender.close()


# ---------------------------------------------------------------------------- test harness
class Peer:
    def __init__(self, role: str, cfg: dict) -> None:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", PYTHONPATH=path)
        self.proc = subprocess.Popen([sys.executable, __file__, role, json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)

    def go(self, address: str = "") -> None:
        self.proc.stdin.write(f"go {address}\n")
        self.proc.stdin.flush()

    def next_event(self, event: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # the peer's own deadlines bound this read
            if not line:
                raise AssertionError(f"peer exited ({self.proc.wait()}) before {event!r}")
            if not line.startswith("{"):
                continue  # UCX writes its own log lines (e.g. a refused connect) to stdout
            message = json.loads(line)
            if message["event"] == event:
                return message
        raise AssertionError(f"no {event!r} within {timeout_s}s")

    def events(self, event: str, count: int) -> list[dict]:
        return [self.next_event(event) for _ in range(count)]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def start_pair(backend: str, receiver_cfg: dict, sender_cfgs: list[dict]):
    """Receiver and senders started at once and gated; then the receiver expects, then the
    senders start, told the receiver's address."""
    receiver = Peer("receiver", dict(receiver_cfg, backend=backend, gate=True))
    senders = [Peer("sender", dict(cfg, backend=backend, gate=True)) for cfg in sender_cfgs]
    address = receiver.next_event("address")["address"]
    for peer in [receiver, *senders]:
        peer.next_event("gated")
    receiver.go()
    receiver.next_event("expecting")
    for sender in senders:
        sender.go(address)
    return receiver, senders


def transfer(rid, src, dst, seed=None, timeout_s=10.0, **extra):
    t = dict(request_id=rid, src=src, dst=dst, layers=[0, 4], timeout_s=timeout_s, **extra)
    if seed is not None:
        t["src_seed"] = seed
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_sent_as_they_finish_land_bitwise_from_two_senders_at_once(backend):
    # One sender posts each layer's blocks as one packed copy, the other run by run; each
    # layer leaves as it "finishes" (a delay between layers), both into one receiver.
    ta = transfer("a", [5, 6, 7, 20, 41, 42], [0, 1, 2, 30, 9, 10], seed=11, layer_delay_s=0.02)
    tb = transfer("b", [1, 2, 9, 4], [20, 21, 40, 23], seed=2, layer_delay_s=0.02)
    receiver, senders = start_pair(backend, dict(transfers=[ta, tb], token="s3cret"),
                                   [dict(seed=11, transfers=[ta], token="s3cret"),
                                    dict(seed=2, transfers=[tb], token="s3cret", unpacked=True)])
    for sender in senders:
        sent = sender.next_event("done")
        assert sent["outcome"] == "ok" and sent["mapped"] == (1 if backend == "mapped" else 0)
    results = receiver.events("done", 2)
    assert all(r["outcome"] == "ok" and r["bitwise"] and r["releases"] == 0 for r in results)
    assert all(s.finish() == 0 for s in senders) and receiver.finish() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_killed_mid_transfer_receiver_raises_and_releases_once(backend):
    t = transfer("a", [1, 2, 3], [4, 5, 6], timeout_s=5.0, layer_delay_s=30.0)
    receiver, (sender,) = start_pair(backend, dict(transfers=[t]),
                                     [dict(seed=3, transfers=[t])])
    sender.next_event("sent_layer")
    time.sleep(0.2)  # layer 0 lands; the sender dies while "computing" layer 1
    sender.kill()
    killed_at = time.monotonic()
    done = receiver.next_event("done")
    assert done["outcome"] == "PeerLost" and done["releases"] == 1
    assert time.monotonic() - killed_at < 3.0  # seen via the control connection, not the deadline
    assert receiver.finish() == 0


@pytest.mark.timeout(60)
@pytest.mark.skipif(__import__("importlib").util.find_spec("ucxx") is None,
                    reason="ucxx not installed")
def test_a_receive_ucx_refuses_fails_that_transfer_alone_and_releases_once():
    # Two transfers on one session, 4 layers x K|V x 2 runs = 16 receives each; the third
    # receive buffer of the process is refused, after two of the first transfer's were
    # posted. That transfer fails at its Announce and releases once; the other lands.
    ta = transfer("a", [1, 2, 9], [4, 5, 20], seed=3, timeout_s=5.0, layer_delay_s=0.1)
    tb = transfer("b", [1, 2, 9], [30, 31, 40], seed=3, timeout_s=5.0, layer_delay_s=0.1)
    receiver, (sender,) = start_pair("ucx", dict(transfers=[ta, tb], refuse_receive=3),
                                     [dict(seed=3, transfers=[ta, tb], unpacked=True)])
    sent = {d["request_id"]: d["outcome"] for d in sender.events("done", 2)}
    done = {d["request_id"]: d for d in receiver.events("done", 2)}
    failed = [rid for rid, d in done.items() if d["outcome"] != "ok"]
    assert len(failed) == 1, done
    (bad,), (good,) = failed, set(done) - set(failed)
    assert done[bad]["outcome"] == "PeerLost" and done[bad]["releases"] == 1, done
    assert done[bad]["elapsed_s"] < 3.0, done  # at its Announce, not at the deadline
    assert sent[bad] != "ok" and sent[good] == "ok", sent
    assert done[good]["bitwise"] and done[good]["releases"] == 0, done
    # The two receives posted before the refusal were flushed: none is left posted.
    assert receiver.next_event("stats")["num_posted"] == 0
    assert sender.finish() == 0 and receiver.finish() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_killed_sender_raises_within_deadline(backend):
    t = transfer("a", [1, 2, 3], [4, 5, 6], timeout_s=5.0, layer_delay_s=0.5)
    receiver, (sender,) = start_pair(backend, dict(transfers=[t]),
                                     [dict(seed=3, transfers=[t])])
    sender.next_event("sent_layer")
    receiver.kill()
    done = sender.next_event("done")
    assert done["outcome"] == "PeerLost" and done["elapsed_s"] < 5.0
    assert sender.finish() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_deadline_aborts_a_slow_sender_on_both_sides(backend):
    # The deadline falls while the sender "computes" layer 1.
    t = transfer("a", [1, 2, 3], [4, 5, 6], timeout_s=1.5, layer_delay_s=3.0)
    receiver, (sender,) = start_pair(backend, dict(transfers=[t]),
                                     [dict(seed=3, transfers=[dict(t, timeout_s=10.0)])])
    done = receiver.next_event("done")
    assert done["outcome"] == "TransferTimeout" and done["releases"] == 1
    assert done["elapsed_s"] < 1.5 + 0.5 + 0.5  # deadline + abort handshake bound + slack
    assert sender.next_event("done")["outcome"] == "TransferCancelled"
    assert sender.finish() == 0 and receiver.finish() == 0


FP8_LAYOUT = dict(LAYOUT, dtype="fp8_e4m3")  # each block: values, then per-token scales
# One mismatch per backend: the receiver's layout, and what the sender's error must say.
MISMATCHES = {"tcp": (FP8_LAYOUT, "dtype fp8_e4m3 at this receiver, bfloat16 at the sender"),
              "ucx": (dict(LAYOUT, head_dim=64), "head_dim 64 at this receiver, 32 at the sender"),
              "mapped": (dict(LAYOUT, num_kv_heads=4),
                         "num_kv_heads 4 at this receiver, 2 at the sender")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_is_a_clear_error_naming_both_before_any_data_moves(backend):
    layout, words = MISMATCHES[backend]
    t = transfer("a", [1, 2], [3, 4], timeout_s=1.0)
    receiver, (sender,) = start_pair(backend, dict(transfers=[t], layout=layout),
                                     [dict(seed=3, transfers=[t])])
    sent = sender.next_event("done")
    assert sent["outcome"] == "LayoutMismatch" and words in sent["error"], sent
    done = receiver.next_event("done")
    assert done["outcome"] == "TransferTimeout" and done["pool_nonzero"] == 0
    assert sender.finish() == 0 and receiver.finish() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "tcp"])  # ucx, mapped
def test_an_fp8_pools_blocks_land_with_their_scales(backend):
    t = transfer("a", [5, 6, 41], [0, 30, 9], seed=11)
    receiver, (sender,) = start_pair(backend, dict(transfers=[t], layout=FP8_LAYOUT),
                                     [dict(seed=11, transfers=[t], layout=FP8_LAYOUT)])
    assert sender.next_event("done")["outcome"] == "ok"
    done = receiver.next_event("done")
    assert done["outcome"] == "ok" and done["bitwise"]
    assert sender.finish() == 0 and receiver.finish() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_four_hundred_transfers_leave_no_growth(backend):
    # From the 100th to the 400th: 300 transfers, enough for a descriptor, mapping or task
    # left behind per transfer to show, or 27 KiB of memory each (the bound is 8 MiB).
    loop = dict(count=400, src=[1, 2, 5], dst=[7, 8, 3])
    receiver = Peer("receiver", dict(backend=backend, transfers=[], loop=loop))
    sender = Peer("sender", dict(backend=backend, seed=3, loop=loop, gate=True))
    address = receiver.next_event("address")["address"]
    sender.next_event("gated")
    sender.go(address)
    s100, s400 = sender.events("checkpoint", 2)
    r100, r400 = receiver.events("checkpoint", 2)
    stats = receiver.next_event("stats")
    for a, b in ((s100, s400), (r100, r400)):
        assert b["num_maps"] <= a["num_maps"] + 2, (a, b)  # no new shm/registered segments
        assert b["num_fds"] == a["num_fds"] and b["num_tasks"] <= a["num_tasks"]
        assert b["rss_kb"] < a["rss_kb"] + 8 * 1024, (a, b)
    assert s400["num_links"] == 1 and s400["num_sender_tasks"] == 0
    assert s400["num_endpoints"] == (1 if backend == "ucx" else 0)
    assert s400["num_mapped"] == (1 if backend == "mapped" else 0)
    assert r400["num_sessions"] == 1
    assert stats["num_expected"] == 0 and stats["num_posted"] == 0 and stats["num_tasks"] == 0
    assert sender.finish() == 0 and receiver.finish() == 0


if __name__ == "__main__":
    role, config = sys.argv[1], json.loads(sys.argv[2])
    import uvloop
    uvloop.run(_run_receiver(config) if role == "receiver" else _run_sender(config))
