"""Why a generation ended: one enum from the engine through the wire to the OpenAI answer.

    STOP    EOS, a stop token id or a stop string       -> OpenAI "stop"
    LENGTH  max_tokens reached, or no room left to grow -> OpenAI "length"
    ABORT   the client, the gateway or a shutdown ended it (no OpenAI reason: the stream
            ends with an error event, or the client is gone)
    ERROR   the engine can never run it (e.g. a prompt larger than the whole KV pool); it
            never crosses the wire as a finish reason: workers answer with an ErrorFrame

A `StrEnum`: members compare equal to their OpenAI strings and encode as them.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    @property
    def is_openai_reason(self) -> bool:
        """True for the reasons an OpenAI response may carry ("stop", "length")."""
        return self in (FinishReason.STOP, FinishReason.LENGTH)
