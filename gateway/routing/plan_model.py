"""Predicted latency of each way to serve one request: pure functions over worker snapshots.

Each worker publishes a `StepModel` (protocol/worker_load.py): one engine step costs

    step(T, B, C) = base + a*T + b*B + c*C     (T prefill tokens, B decoding seqs, C context)

and its queue: Q prompt tokens still to prefill in N prompts, B sequences decoding over C
tokens, and a step budget of M tokens. For a request of P prompt tokens, H of them cached
on the worker that prefills it, with a TTFT target and a TPOT target:

    local on D       the engine prefills shortest remaining first (engine/request_rank.py):
                     of the queue, at most A = min(Q_D, N_D * U) tokens go before this
                     prompt's U = P - H_D, so it is done after n = ceil((A + U) / (M_D - B_D))
                     steps, each also decoding D's B_D sequences and filled with the rest of
                     the queue: prefill work W = min(Q_D + U, n * (M_D - B_D)) tokens,
                       TTFT        = a_D*W + n * step_D(0, B_D, C_D)
                                     + a_D * min(Q_D, M_D - B_D)   (the chunk in progress,
                                       which the prompt arrives in the middle of)
                       D's running requests' TPOT while it lasts: step_D(min(W, M_D - B_D), B_D, C_D)
                       this request's TPOT afterwards:            step_D(0, B_D + 1, C_D + P),
                         its first ceil(Q_D / (M_D - B_D - 1)) steps (at most max_tokens) mixed
                         with a chunk of the queue: step_D(min(Q_D, M_D - B_D - 1), B_D + 1, ..)
    P prefills, D    TTFT        = the same on P (its own queue; P decodes nothing, or its B_P),
    decodes                        and at least D's current step: the reservation is taken on
                                   D's engine thread between two steps, and P's first token
                                   goes out once D's answer has reached P (a D in the middle
                                   of a long prompt's chunk holds it for that chunk):
                                   step_D(min(Q_D, M_D - B_D), B_D, C_D), 0 for an idle D
                     transfer    = P * kv_bytes_per_token / P's measured push rate
                     this request's TPOT ~ as after a local prefill on D (D's queue mixed
                                   into its first steps) + transfer / max_tokens
                     D's running requests' TPOT: unchanged (one more sequence); P's own
                     running requests (a BOTH worker): stretched as in a local prefill on P

A short prompt behind a long one is thus one full step away, not the long prompt's whole
prefill; behind many prompts as short as itself, it waits for all of them (as in arrival
order). Older prompts of its tier that waited long, and higher tiers, go first anyway (the
engine's aging): the prediction does not know the tiers in the queue. The queue is the one
of the moment of routing: what the worker last reported, and at least the prompts this
gateway routed to it and has not seen prefilled (gateway/routing/router.py, `load_at_routing`).

D's decode steps are also stretched by the prompts it prefills for anyone: a worker that
spends a fraction u = a_D * (its recent prefill tokens/s) of its time prefilling advances
its decodes once per step of the rest, so every TPOT on D is divided by (1 - u) (u capped
at MAX_PREFILL_BUSY).

Each prediction gets a score, its worst ratio to a target: TTFT / ttft target, the
request's TPOT / tpot target, and the running TPOT of the worker that prefills (when it
decodes anything) / the strictest TPOT of any tier (what its running requests may need).
Score < 1 meets every target. A worker whose decode steps alone, step(0, B, C), already take
more than RUNNING_HEADROOM of the strictest TPOT (a CPU, or a GPU decoding far more than it
should) holds it by chance if at all, whatever this plan does: the running-TPOT ratio is
then left out of the score, and the stall the prefill adds to those running requests stays
in the cost. Otherwise every plan that prefills on such a worker would count as a miss (on
a CPU a decode step of the default model takes 49-54 ms against the strictest 50 ms, so a
5-token prefill beside it would), and a short prompt would be sent to wait behind a long
prefill elsewhere rather than be prefilled at once beside the running streams. And a cost,
in seconds of latency the plan adds to the cluster:

    cost = TTFT + max_tokens * TPOT                  (this request, start to end)
         + B_P * a_P * (P - H_P)                     (P's running decodes, stalled by the prefill)
         + B_D * (b_D + c_D * P) * max_tokens        (D's running decodes, one more sequence)

Cached tokens H count the worker's host KV tier too (docs/running.md "The host KV tier"):
of H, the R it holds in host memory rather than its KV cache are copied back before the
prompt's first step, which adds reload = R * kv_bytes_per_token / its measured host-to-device
rate to the TTFT of the worker that prefills (`reload_s`).

The router takes, among the plans that meet every target, the cheapest (so prefills
gravitate to workers that decode little and decodes to workers that prefill little: the
split a static 1P+1D cluster is built around, found from the load); when none meets
them, the smallest score (the least miss).

A term a worker has never measured (no prefill steps yet: `num_prefill_samples == 0`) is
borrowed from the median of the workers that have; a worker with no model at all makes the
snapshot unpredictable (`predictable` is False) and the router falls back to its
token-cost rule.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from protocol.worker_load import StepModel, WorkerLoad

DEFAULT_KV_BYTES_PER_S = 1e9  # before a worker has pushed anything: a slow TCP link
# A worker that publishes no host-to-device rate (an older one): a slow PCIe link.
DEFAULT_HOST_RELOAD_BYTES_PER_S = 4e9
MAX_PREFILL_BUSY = 0.9  # the share of a worker's time prefill may be predicted to take
# A worker's decode steps alone within this share of the strictest TPOT hold it: only then
# does a plan answer for stretching them (module doc).
RUNNING_HEADROOM = 0.8


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float
    tpot_s: float
    strictest_tpot_s: float  # the smallest TPOT target of any tier: what running requests need
    max_tokens: int

    def __post_init__(self) -> None:
        if min(self.ttft_s, self.tpot_s, self.strictest_tpot_s) <= 0 or self.max_tokens < 1:
            raise ValueError(f"targets must be positive: {self}")


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float
    tpot_s: float  # this request's
    running_tpot_s: float  # of the prefilling worker's running requests while this prefills
    score: float  # worst ratio to a target (< 1: every target met)
    ratio_sum: float
    cost_s: float  # latency this plan adds: this request's and its workers' running ones


@dataclass(frozen=True, slots=True)
class WorkerSide:
    """What the prediction needs of one worker."""

    load: WorkerLoad
    model: StepModel
    max_batched_tokens: int
    kv_bytes_per_token: int


def complete_models(models: Sequence[StepModel | None]) -> list[StepModel] | None:
    """Every worker's model with unmeasured terms borrowed from its peers; None when a worker
    has no model at all (the snapshot is not predictable)."""
    if not models or any(m is None for m in models):
        return None
    known = [m for m in models if m is not None]
    prefill_rates = [m.prefill_token_s for m in known if m.num_prefill_samples]
    decode_terms = [(m.decode_seq_s, m.context_token_s) for m in known if m.num_decode_samples]
    out = []
    for m in known:
        if not m.num_prefill_samples:
            if not prefill_rates:
                return None  # nobody has prefilled yet: nothing to predict a prefill with
            m = msgspec.structs.replace(m, prefill_token_s=statistics.median(prefill_rates))
        if not m.num_decode_samples and decode_terms:
            m = msgspec.structs.replace(
                m, decode_seq_s=statistics.median(t[0] for t in decode_terms),
                context_token_s=statistics.median(t[1] for t in decode_terms))
        out.append(m)
    return out


def prefill_work(load: WorkerLoad, uncached: int, max_batched_tokens: int) -> tuple[int, int]:
    """(prompt tokens the worker computes until this prompt's last one, in how many steps),
    for a prompt of `uncached` tokens joining `load`'s queue (the module doc's W and n)."""
    own = max(uncached, 1)
    num_prompts = load.num_waiting + load.num_running - load.num_decoding
    ahead = min(load.num_queued_prefill_tokens, max(num_prompts, 1) * own)
    per_step = max(1, max_batched_tokens - load.num_decoding)
    steps = math.ceil((ahead + own) / per_step)
    return min(load.num_queued_prefill_tokens + own, steps * per_step), steps


def _prefill_time(side: WorkerSide, uncached: int) -> tuple[float, float, float]:
    """(seconds until this prompt's first token, step time while prefilling, the seconds
    the prefill stalls the worker's running decodes in all)."""
    load, m = side.load, side.model
    work, steps = prefill_work(load, uncached, side.max_batched_tokens)
    per_step = max(1, side.max_batched_tokens - load.num_decoding)
    decode_part = m.step_s(0, load.num_decoding, load.num_context_tokens)
    ttft = m.prefill_token_s * work + steps * decode_part + _chunk_in_progress(side)
    mixed = m.step_s(min(work, per_step), load.num_decoding, load.num_context_tokens)
    return ttft, mixed, load.num_decoding * m.prefill_token_s * max(uncached, 0)


def _running_charged(side: WorkerSide, targets: Targets) -> bool:
    """Whether the plan answers for the running TPOT of this prefilling worker: it decodes
    something, and its decode steps alone meet the strictest TPOT with room to spare
    (module doc)."""
    load, m = side.load, side.model
    decode_only = m.step_s(0, load.num_decoding, load.num_context_tokens)
    return load.num_decoding > 0 and decode_only <= RUNNING_HEADROOM * targets.strictest_tpot_s


def _chunk_tokens(side: WorkerSide) -> int:
    """Prompt tokens of the worker's queue in the step it is computing now."""
    load = side.load
    return min(load.num_queued_prefill_tokens, max(0, side.max_batched_tokens - load.num_decoding))


def _chunk_in_progress(side: WorkerSide) -> float:
    """The prefill chunk the worker is computing now, which a prompt arriving at it waits
    for before its own step (a decode-only step is short and left out); 0 when it prefills
    nothing."""
    return side.model.prefill_token_s * _chunk_tokens(side)


def _current_step(side: WorkerSide) -> float:
    """How long the worker's engine thread is busy with the step it is in (what a
    reservation waits for): a chunk of its queue beside its decodes; 0 when idle."""
    load, m = side.load, side.model
    chunk = _chunk_tokens(side)
    if chunk == 0 and load.num_decoding == 0:
        return 0.0
    return m.step_s(chunk, load.num_decoding, load.num_context_tokens)


def _decoding(side: WorkerSide, prompt_len: int, max_tokens: int) -> tuple[float, float]:
    """(this request's TPOT on the worker, the seconds one more sequence adds to the
    worker's running decodes over its max_tokens steps)."""
    load, m = side.load, side.model
    busy = min(MAX_PREFILL_BUSY, m.prefill_token_s * load.prefill_tokens_per_s)
    decoding, context = load.num_decoding + 1, load.num_context_tokens + prompt_len
    step = m.step_s(0, decoding, context) / (1.0 - busy)
    added = load.num_decoding * (m.decode_seq_s + m.context_token_s * prompt_len) * max_tokens
    # The prompts queued there now share the next steps with this request's decodes: each
    # of those steps also computes a chunk of them, until the queue is done.
    per_step = max(1, side.max_batched_tokens - decoding)
    num_mixed = min(max_tokens, math.ceil(load.num_queued_prefill_tokens / per_step))
    if num_mixed:
        mixed = m.step_s(min(load.num_queued_prefill_tokens, per_step), decoding, context)
        step = (num_mixed * max(mixed, step) + (max_tokens - num_mixed) * step) / max_tokens
    return step, added


def _predict(ttft: float, tpot: float, running_tpot: float, has_running: bool,
             harm_s: float, targets: Targets) -> Prediction:
    ratios = [ttft / targets.ttft_s, tpot / targets.tpot_s]
    if has_running:
        ratios.append(running_tpot / targets.strictest_tpot_s)
    cost = ttft + targets.max_tokens * tpot + harm_s
    return Prediction(ttft, tpot, running_tpot, max(ratios), sum(ratios), cost)


def reload_s(load: WorkerLoad, kv_bytes_per_token: int, tokens: int) -> float:
    """Seconds to copy `tokens` tokens' KV back from the worker's host KV tier: bytes over
    the host-to-device rate it measured (a host hit's price, between a device hit's 0 and
    recomputing the tokens)."""
    rate = load.host_reload_bytes_per_s or DEFAULT_HOST_RELOAD_BYTES_PER_S
    return max(0, tokens) * kv_bytes_per_token / rate


def predict_local(decode: WorkerSide, prompt_len: int, cached: int,
                  targets: Targets, reloaded: int = 0) -> Prediction:
    """`cached`: prompt tokens not computed, of which `reloaded` come back from the host
    KV tier before the prompt's first step (they add their copy to the TTFT)."""
    ttft, mixed, stall = _prefill_time(decode, prompt_len - cached)
    ttft += reload_s(decode.load, decode.kv_bytes_per_token, reloaded)
    tpot, added = _decoding(decode, prompt_len, targets.max_tokens)
    return _predict(ttft, tpot, mixed, _running_charged(decode, targets), stall + added,
                    targets)


def predict_split(prefill: WorkerSide, decode: WorkerSide, prompt_len: int,
                  cached_on_prefill: int, held_on_decode: int, targets: Targets,
                  reloaded_on_prefill: int = 0) -> Prediction:
    ttft, mixed, stall = _prefill_time(prefill, prompt_len - cached_on_prefill)
    ttft += reload_s(prefill.load, prefill.kv_bytes_per_token, reloaded_on_prefill)
    ttft = max(ttft, _current_step(decode))
    rate = prefill.load.kv_send_bytes_per_s or DEFAULT_KV_BYTES_PER_S
    transfer = (prompt_len - held_on_decode) * prefill.kv_bytes_per_token / rate
    tpot, added = _decoding(decode, prompt_len, targets.max_tokens)
    # The prefill stretches the steps of whatever P itself decodes (a BOTH worker).
    return _predict(ttft, tpot + transfer / targets.max_tokens, mixed,
                    _running_charged(prefill, targets), stall + added, targets)
