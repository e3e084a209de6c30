"""A heartbeat file: proof, for the process that started this one, that its event loop turns.

`pdserve up` gives its gateways and its operations agent `--heartbeat-file PATH`; each
sets PATH's modification time to now every `PERIOD_S`, from a task on its event loop. A
loop that stops turning (SIGSTOP, a call that blocks it, a deadlock) stops touching the
file, and the supervisor, which reads its age (launcher/liveness.py), kills the process so
that it is started again. The file holds nothing; only its time counts.

Owned task: `start()` creates it, `stop()` cancels and awaits it. A failed touch (a full or
vanished folder) is logged once and retried at the next beat: the supervisor then sees the
beats stop and acts as for a frozen loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PERIOD_S = 1.0


class Heartbeat:
    def __init__(self, path: Path, period_s: float = PERIOD_S) -> None:
        if period_s <= 0:
            raise ValueError(f"heartbeat period must be positive, got {period_s}")
        self.path = path
        self.period_s = period_s
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def beat(self) -> None:
        """Set the file's time to now (creating it, mode 0600, the first time)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.utime(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failing:
                log.error("heartbeat: cannot touch %s (%s); retrying every %.1f s",
                          self.path, exc, self.period_s)
            self._failing = True
            return
        self._failing = False

    def start(self) -> None:
        if self._task is None:
            self.beat()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.beat()
