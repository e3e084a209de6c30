"""The modes of benchmarks/kv_transfer.py: what each one moves and how it is timed.

  ucx      this backend over UCX (announce + every layer + receiver confirmation); packed
           (gather -> one message per layer group -> scatter) where the policy says so
  ucx_per_run  the same with packing off: one zero-copy message per (layer, K|V, run)
  tcp      this backend over TCP
  tcp_per_run  the same with packing off
  mapped   this backend with the receiver's pool mapped by the sender (CUDA IPC on a GPU,
           the pool's memfd on the host): one-pass copies, no data messages; timed like ucx
  MODE_data  any of the five above (ucx_data, ucx_per_run_data, tcp_data, ...,
           mapped_data), timed from the first send_layer: the announce round trip, which a
           prefill worker starts before its prompt is computed, left out
  MODE_recv  the same, timed from the first send_layer until the receiver's transfer
           completed (its clock: one host), not until the sender heard back: when a decode
           worker may use the blocks
  raw_ucx  ucxx tag send/recv of one contiguous buffer of the same size, same path
  raw_ucx_recv  the same, timed until the receiver's recv completed (as mapped_recv)
  raw_tcp  a uvloop TCP stream into a preallocated buffer (BufferedProtocol)
  copy     one copy in one process (numpy on CPU, device-to-device torch copy on CUDA)
"""

from __future__ import annotations

BACKEND_MODES = ("ucx", "ucx_per_run", "tcp", "tcp_per_run", "mapped")
RAW_MODES = ("raw_ucx", "raw_ucx_recv", "raw_tcp", "copy")


def split_mode(mode: str) -> tuple[str, str]:
    """(backend mode, timing: "all", "data" or "recv") of a mode of this backend; ("", "")
    for the raw modes and the checks."""
    for timing in ("data", "recv"):
        if mode.endswith("_" + timing) and mode[:-len(timing) - 1] in BACKEND_MODES:
            return mode[:-len(timing) - 1], timing
    return (mode, "all") if mode in BACKEND_MODES else ("", "")


def backend_of(mode: str, device: str) -> tuple[str, bool]:
    """(carrier, mapping on) of a backend mode; mapped GPU pools keep UCX as their
    (idle) carrier, since the TCP carrier takes host pools only."""
    if mode.startswith("mapped") or mode == "check_mapped":
        return ("ucx" if device == "cuda" else "tcp"), True
    return ("ucx" if mode == "check" else mode.split("_")[0]), False
