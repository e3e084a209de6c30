"""InFlightStep: an overlapped step whose sampled tokens are still on the device.

An overlapped engine step (`LLMEngine.step(overlap=True)`) plans step N+1 before the host
has step N's tokens, so the host's share of a step hides behind the device's compute:

    call k:  schedule N+1 ─▶ queue N+1 (decode inputs: N's tokens, on the device)
             ─▶ resolve N (wait for N's tokens only; stop rules, text, outputs of N)
             ─▶ queue sampling of N+1 ─▶ record N+1's tokens as PLACEHOLDERs ─▶ return
    call k+1: schedule N+2 while the device computes N+1 ...

What changes against a plain step, and why nothing a client sees does:
  * a request that stops at step N (EOS, stop token or string) is found while N+1 computes:
    N+1 carries a row for it, whose token is never sampled, and its KV write lands in
    blocks that the scheduler already freed; later steps run after N+1 on the same stream,
    so a block's next owner writes after it;
  * the sampler for N+1 runs after N was resolved, so penalties, min_tokens and seeded
    draws see every earlier token, as in a plain step;
  * max_tokens and PREFILL_ONLY end a request when N+1's tokens are recorded (their count,
    not their value, decides); their output, with the token, comes when N+1 is resolved.

Invariants (`check_invariants`): one row per sampled request, in the order of `tracked`;
each row's request has PLACEHOLDER as its last output token until resolved; `rows` maps
each request id to its row in `pending.token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_runner import DeviceTokens
from engine.output_processor import Tracked
from engine.pending_sample import PendingSample
from engine.request import PLACEHOLDER


@dataclass(frozen=True, slots=True)
class InFlightStep:
    tracked: tuple[Tracked, ...]  # the sampled requests, one per row
    pending: PendingSample

    @property
    def device_tokens(self) -> DeviceTokens:
        return DeviceTokens(self.pending.token_ids,
                            {t.request.request_id: row for row, t in enumerate(self.tracked)})

    def holds(self, request_id: str) -> bool:
        return any(t.request.request_id == request_id for t in self.tracked)

    def check_invariants(self) -> None:
        if self.pending.token_ids.shape[0] != len(self.tracked):
            raise AssertionError(f"{self.pending.token_ids.shape[0]} sampled rows for "
                                 f"{len(self.tracked)} requests")
        # One pass (the engine checks every step): each row's last output is a PLACEHOLDER.
        if [t.request.output_token_ids[-1] for t in self.tracked].count(PLACEHOLDER) \
                != len(self.tracked):
            pending = [t.request.request_id for t in self.tracked if not t.request.token_pending]
            raise AssertionError(f"{pending} in flight without a PLACEHOLDER")
