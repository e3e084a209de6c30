"""How busy one worker is, and how fast its engine steps: what the gateway routes on.

`WorkerLoad` is taken by the engine thread after every step or command
(engine/engine_thread.py); the worker runtime adds the token rates, the fitted
`StepModel` and the KV transfer rate, and publishes it in a `LoadReport`
(protocol/messages.py); the gateway's router predicts each plan's latency from it
(gateway/routing/plan_model.py) and `/admin/workers` shows it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class StepModel(msgspec.Struct, frozen=True, kw_only=True):
    """One engine step's time, fitted by the worker from its own steps
    (worker/step_fit.py):

        step_s = base_s + prefill_token_s * prefill tokens of the step
                        + decode_seq_s * decoding sequences
                        + context_token_s * tokens those sequences attend over

    Prefill throughput is 1 / prefill_token_s; a decode step of B sequences over C context
    tokens costs base_s + B * decode_seq_s + C * context_token_s; a prefill chunk of T
    tokens mixed into it stretches that step by T * prefill_token_s. Every term >= 0.
    A term fitted from no step that had it (`num_prefill_samples` or `num_decode_samples`
    is 0) is unknown, not free: the router borrows it from a peer.
    """

    base_s: NonNegFloat
    prefill_token_s: NonNegFloat
    decode_seq_s: NonNegFloat
    context_token_s: NonNegFloat
    num_samples: NonNegInt = 0
    num_prefill_samples: NonNegInt = 0  # steps that prefilled something
    num_decode_samples: NonNegInt = 0  # steps that decoded something

    def step_s(self, prefill_tokens: float, decode_seqs: float, context_tokens: float) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens
                + self.decode_seq_s * decode_seqs + self.context_token_s * context_tokens)


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's queues and KV pool (engine counters), rates and fitted step model."""

    num_waiting: NonNegInt = 0
    num_running: NonNegInt = 0
    num_kv_blocks_used: NonNegInt = 0
    num_kv_blocks_total: NonNegInt = 0
    num_held_tables: NonNegInt = 0  # requests, parked prefills and reservations holding blocks
    num_steps: NonNegInt = 0
    num_queued_prefill_tokens: NonNegInt = 0  # prompt tokens waiting or mid-prefill
    num_decoding: NonNegInt = 0  # running sequences past their prefill
    num_context_tokens: NonNegInt = 0  # tokens those sequences attend over
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    step_model: StepModel | None = None  # None until enough steps were seen
    kv_send_bytes_per_s: NonNegFloat = 0.0  # KV this worker pushed, recent rate (0: unknown)
    # Mixture-of-experts models, per MoE layer over the last window (engine/expert_load.py):
    # the most used expert's assignments over the mean, and its id. Empty: a dense model.
    moe_imbalance: list[Annotated[float, msgspec.Meta(ge=1.0)]] = []
    moe_hottest: list[NonNegInt] = []
    # With expert parallelism (`--ep`): the busiest rank's tokens over the mean, per MoE layer
    # (empty without), and the expert placements switched so far (hot experts copied).
    moe_rank_imbalance: list[Annotated[float, msgspec.Meta(ge=1.0)]] = []
    num_expert_rebalances: NonNegInt = 0
    # The last switch: the busiest rank over the mean in the window that decided it, and for
    # that window's tokens under the new placement, averaged over MoE layers (0.0: none yet;
    # a switch changes only layers it improves, so the second is below the first).
    last_switch_imbalance: NonNegFloat = 0.0
    last_switch_planned: NonNegFloat = 0.0
    num_host_blocks_used: NonNegInt = 0  # blocks held by the host KV tier
    num_host_blocks_total: NonNegInt = 0  # the host KV tier's size (0: the worker has none)
    host_reload_bytes_per_s: NonNegFloat = 0.0  # its host-to-device copy rate (0: unknown)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool in use; 1.0 for an unknown (empty) pool."""
        if self.num_kv_blocks_total <= 0:
            return 1.0
        return self.num_kv_blocks_used / self.num_kv_blocks_total
