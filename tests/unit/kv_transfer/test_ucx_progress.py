"""The UCX progress driver sleeps when idle and keeps a transfer moving while there is work.

A real ucxx worker on loopback: what a worker does after its first transfer is what
matters (ucxx's own blocking mode then progresses on every loop iteration, ~100% of a core).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ucxx = pytest.importorskip("ucxx")

from ucxx._lib.arr import Array  # noqa: E402
from ucxx.types import Tag  # noqa: E402

from kv_transfer.ucx import UcxWorker  # noqa: E402

pytestmark = pytest.mark.timeout(30)


async def _transfer(worker: UcxWorker, num_bytes: int, tag: int) -> np.ndarray:
    endpoint = await worker.loopback()
    into = np.zeros(num_bytes, dtype=np.uint8)
    request = worker.ctx.worker.tag_recv(Array(into), Tag(tag))
    worker.progress.kick()
    await endpoint.send(np.full(num_bytes, tag % 251, dtype=np.uint8), tag=tag, force_tag=True)
    await request.wait()
    return into


def test_idle_after_transfers_means_asleep_not_spinning() -> None:
    async def scenario() -> None:
        worker = UcxWorker()
        progress = worker.progress
        try:
            for i, size in enumerate((1, 4096, 1 << 20)):
                got = await _transfer(worker, size, tag=100 + i)
                assert (got == (100 + i) % 251).all()
                progress.check_invariants()
            await asyncio.sleep(0.2)  # past the linger: the worker arms and sleeps
            assert progress.is_armed
            before = progress.num_progress_calls
            await asyncio.sleep(1.0)
            # Asleep, only the safety tick progresses (once a second): the old behaviour
            # was one call per loop iteration, thousands a second.
            assert progress.num_progress_calls - before <= 3
            progress.check_invariants()
            # And it wakes for the next transfer.
            assert (await _transfer(worker, 1 << 16, tag=7) == 7).all()
        finally:
            worker.close()
        assert not progress.is_armed

    asyncio.run(scenario())


def test_a_new_worker_logs_no_unused_variable_warning() -> None:
    """ucxx's import sets UCX_MEMTYPE_CACHE too late for UCX to read it; unless the worker
    drops it, every process logs a UCX warning that its operator cannot act on."""
    code = ("import asyncio\nfrom kv_transfer.ucx import UcxWorker\n"
            "async def main():\n    UcxWorker()\nasyncio.run(main())\nprint('made')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=25, env=env, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0 and "made" in done.stdout, done.stderr
    printed = done.stdout + done.stderr  # UCX logs to stdout
    assert "unused environment variable" not in printed, printed
