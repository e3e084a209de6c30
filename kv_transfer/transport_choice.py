"""Which KV transport a worker uses: "auto" resolved to "ucx" or "tcp", and the refusal,
before anything starts, of a transport that cannot move the device's pool.

Light on purpose (no torch): `pdserve up` checks its workers' devices with it before it
starts any process. The TCP carrier reads and writes host memory only (tcp.py), so a CUDA
pool needs UCX; "auto" without `ucxx` installed falls back to TCP and says so in the log.
"""

from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger(__name__)


def ucx_available() -> bool:
    return importlib.util.find_spec("ucxx") is not None


def check_backend_for_device(name: str, device: str, ucx_importable: bool) -> None:
    """Refuse, before anything starts, a KV transport that cannot move this device's pool:
    the TCP carrier reads and writes host memory only, so a CUDA pool needs UCX."""
    if not device.startswith("cuda"):
        return
    if name == "tcp":
        raise ValueError("--kv-transport tcp moves host (CPU) KV pools only; on CUDA use "
                         "--kv-transport ucx (or auto)")
    if not ucx_importable:
        raise ValueError("a CUDA KV pool moves over UCX, and ucxx is not installed: "
                         "install it (pip install ucxx-cu13, or ucxx-cu12 for CUDA 12; "
                         "`make setup` installs the ucx extra) or run with --device cpu")


def resolve_backend(name: str) -> str:
    if name not in ("auto", "ucx", "tcp"):
        raise ValueError(f"unknown KV transfer backend {name!r} (auto, ucx, tcp)")
    if name == "auto":
        if ucx_available():
            return "ucx"
        log.warning("ucxx is not installed: KV transfer uses the TCP backend")
        return "tcp"
    if name == "tcp":
        log.info("KV transfer uses the TCP backend (chosen explicitly)")
    return name
