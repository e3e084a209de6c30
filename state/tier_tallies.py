"""The stream in which gateways tell the operations agent how their requests went, per tier
(protocol/tier_tally.py). This module alone reads and writes it (docs/redis_schema.md):

    {ns}:tier_tallies   STREAM  field "t": GatewayTally (JSON), one entry per gateway replica
                                per interval with traffic, MAXLEN ~ 2000

Gateways append (their Redis user writes every key of the namespace); the agent reads what
was appended since the last entry it read, so two agents (a leader and a standby) each read
every entry, and nobody deletes one (the stream is capped).
"""

from __future__ import annotations

import msgspec

from protocol.tier_tally import GatewayTally
from state.redis_state import RedisState

TALLIES_MAXLEN = 2000
MAX_READ = 500  # entries per read: ~a minute of ten replicas' tallies
_TALLIES = "tier_tallies"


class TallyStream:
    """Typed operations on {ns}:tier_tallies; every call under the state's op deadline."""

    def __init__(self, state: RedisState) -> None:
        self.state = state
        self._decoder = msgspec.json.Decoder(GatewayTally)

    @property
    def key(self) -> str:
        return f"{self.state.ns}:{_TALLIES}"

    async def publish(self, tally: GatewayTally, timeout_s: float | None = None) -> None:
        async with self.state.deadline(timeout_s):
            await self.state.client.xadd(self.key, {"t": msgspec.json.encode(tally)},
                                         maxlen=TALLIES_MAXLEN, approximate=True)

    async def read_after(self, last_id: str | None, timeout_s: float | None = None
                         ) -> tuple[str, list[GatewayTally]]:
        """The entries after `last_id`, oldest first, and the id to read after next time.
        `last_id` None: none of what is there now (a reader starts at the present)."""
        async with self.state.deadline(timeout_s):
            if last_id is None:
                newest = await self.state.client.xrevrange(self.key, count=1)
                return (_text(newest[0][0]) if newest else "0-0"), []
            rows = await self.state.client.xrange(self.key, min=f"({last_id}", count=MAX_READ)
        tallies = []
        for entry_id, fields in rows or []:
            last_id = _text(entry_id)
            try:
                tallies.append(self._decoder.decode((fields or {})[b"t"]))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a gateway's: skipped, never fatal
        return last_id, tallies


def _text(entry_id: bytes | str | None) -> str:
    if entry_id is None:
        return "0-0"
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
