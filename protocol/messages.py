"""Every message that crosses a process boundary, as versioned msgspec Structs.

Wire format: one msgpack array `[PROTOCOL_VERSION, message]`, where `message` is a tagged
Struct (the `type` field names it). The version sits outside the message so a peer on
another version gets a clear `ProtocolVersionError`, not a confusing field error.

Who sends what (one HTTP call per arrow; see rpc/control_server.py for the transport):

    gateway ──ReserveRequest──────▶ decode    ◀── ReserveResponse | ErrorFrame
    gateway ──PrefillRequest──────▶ prefill   ◀── frames: PrefillResult, TransferResult
                                                  (the first token arrives before the KV lands)
    gateway ──DestinationNotice───▶ prefill   ◀── DestinationAck   (a PrefillRequest sent with
              `destination_follows`, at once beside the ReserveRequest: D's answer, forwarded)
    prefill ══ KV blocks (kv_transfer/; its own control messages) ══▶ decode
    gateway ──DecodeRequest───────▶ decode    ◀── frames: TokenFrame ... (last has finish_reason)
    gateway ──AbortRequest────────▶ prefill and decode (any time; idempotent)
    workers ──WorkerInfo, LoadReport, PrefixIndexEvent──▶ Redis (state/redis_state.py)

Any response or stream may end with an `ErrorFrame` instead. Time budgets travel as
`timeout_ms` (the time left when sent); each receiver starts its own clock on receipt.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Union

import msgspec

# The envelope and its codec, re-exported: most callers import them from here.
from protocol.codec import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, MessageDecoder,
                            MessageTooLargeError, ProtocolError, ProtocolVersionError, decode,
                            encode)
from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams
from protocol.worker_load import WorkerLoad

# Bounds enforced while decoding, so a hostile peer cannot make a worker allocate without
# limit; generous for real use (1M-token prompts, 64 MiB messages).
MAX_TOKENS_PER_MESSAGE = 1 << 20
MAX_BLOCKS_PER_MESSAGE = 1 << 20
MAX_HASHES_PER_EVENT = 1 << 16
MAX_TEXT_CHARS = 1 << 20
MAX_ID_CHARS = 256
MAX_TOP_LOGPROBS = 20
# Time budgets a peer may ask for: one hour for a request, ten minutes for a reservation
# (blocks held for KV that has not arrived), so nobody can pin a worker's memory for long.
MAX_TIMEOUT_MS = 3_600_000
MAX_RESERVATION_MS = 600_000

TokenIds = Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS_PER_MESSAGE)]
BlockIds = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_MESSAGE)]
BlockHashes = Annotated[list[int], msgspec.Meta(max_length=MAX_HASHES_PER_EVENT)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
# Worker ids become parts of Redis keys and URLs: keep them to a safe alphabet. The names of
# a cluster's other processes (in any case) are never a worker id, so no registry entry can
# name one of them to anything that acts on workers.
RESERVED_WORKER_IDS = ("gateway", "agent", "redis", "redis-server", "valkey", "valkey-server",
                       "launcher", "supervisor", "up", "bench", "generate")
WORKER_ID_PATTERN = (r"^(?!(?i:" + "|".join(re.escape(n) for n in RESERVED_WORKER_IDS)
                     + r")$)[A-Za-z0-9_.\-]{1,128}$")
WorkerId = Annotated[str, msgspec.Meta(pattern=WORKER_ID_PATTERN)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
TimeoutMs = Annotated[int, msgspec.Meta(gt=0, le=MAX_TIMEOUT_MS)]
ReservationMs = Annotated[int, msgspec.Meta(gt=0, le=MAX_RESERVATION_MS)]
# W3C trace context: version-trace_id-parent_id-flags, lower-case hex.
TRACEPARENT_PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
Traceparent = Annotated[str, msgspec.Meta(pattern=TRACEPARENT_PATTERN)]  # W3C: the caller's span

_WORKER_ID = re.compile(WORKER_ID_PATTERN)


def is_worker_id(text: str) -> bool:
    """Could `text` be a worker id (the alphabet, the length, not a reserved name)?"""
    return _WORKER_ID.fullmatch(text) is not None


class Role(enum.StrEnum):
    """What a worker does; registered in its WorkerInfo, read by the gateway's router.

    PREFILL   computes prompts' KV and pushes it to a decode worker's reservation
    DECODE    receives KV into reservations and decodes; prefills prompts locally too
    COLOCATED prefills and decodes every request itself; takes no reservations
    BOTH      any of it: prefills for others (pushing KV), receives KV and decodes, and
              prefills + decodes locally; the router picks per request

    A worker's role can change at run time (POST /internal/role); every worker process can
    take every role.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    BOTH = "both"

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL

    @property
    def prefills_for_others(self) -> bool:
        """Prefills a prompt whose decode runs on another worker (PREFILL, BOTH)."""
        return self in (Role.PREFILL, Role.BOTH)

    @property
    def takes_reservations(self) -> bool:
        """Receives KV pushed by a prefill worker."""
        return self in (Role.DECODE, Role.BOTH)


class TransferStatus(str, enum.Enum):
    PENDING = "pending"  # first token sampled; KV still moving
    DONE = "done"  # every block landed on the destination
    SKIPPED = "skipped"  # nothing to send (no destination, or it held the whole prefix)
    FAILED = "failed"  # the destination must free its reservation


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"
    PROTOCOL_VERSION = "protocol_version"
    UNAUTHORIZED = "unauthorized"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"  # no blocks / queue full: retry elsewhere
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ABORTED = "aborted"
    TRANSFER_FAILED = "transfer_failed"
    PEER_LOST = "peer_lost"  # the other leg of the handoff died
    STALE_EPOCH = "stale_epoch"  # the addressed worker restarted since the route was planned
    WRONG_ROLE = "wrong_role"  # the worker's role changed since the route was planned
    UNKNOWN_REQUEST = "unknown_request"
    INTERNAL = "internal"


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every message; subclasses set `tag=` to their wire name."""



class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=MAX_TOP_LOGPROBS + 1)] = []


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    num_prompt_tokens: NonNegInt
    num_completion_tokens: NonNegInt
    num_cached_tokens: NonNegInt = 0
    num_steps: NonNegInt = 0  # engine steps that computed the request's tokens


class DecodeDestination(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prefill worker writes a request's KV: a reservation on one decode worker.

    block_ids[i] holds prompt positions [i*block_size, (i+1)*block_size). The first
    num_prefix_blocks_held of them already hold this prompt's KV there and are not sent.
    The epoch fences the handoff: a restarted decode worker (new epoch) refuses the KV.
    """

    worker_id: WorkerId
    epoch: NonNegInt
    kv_address: Annotated[str, msgspec.Meta(max_length=4096)]
    block_ids: BlockIds
    num_prefix_blocks_held: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.num_prefix_blocks_held > len(self.block_ids):
            raise ValueError("num_prefix_blocks_held exceeds the number of reserved blocks")


# ---------------------------------------------------------------- gateway <-> workers


class ReserveRequest(Message, tag="reserve_request", frozen=True, kw_only=True):
    """Gateway → decode: hold blocks for a prompt's KV until it lands (or timeout_ms). Too
    few free blocks: wait up to `wait_ms` in line by `priority`, then OVERLOADED."""

    request_id: Id
    prompt_token_ids: TokenIds
    timeout_ms: ReservationMs  # the reservation is freed if no KV and DecodeRequest by then
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_RESERVATION_MS)] = 0
    priority: int = 0  # larger is served first


class ReserveResponse(Message, tag="reserve_response", frozen=True, kw_only=True):
    request_id: Id
    destination: DecodeDestination


class PrefillRequest(Message, tag="prefill_request", frozen=True, kw_only=True):
    """Gateway → prefill: compute the prompt's KV, sample the first token, ship the KV."""

    request_id: Id
    prompt_token_ids: TokenIds
    sampling: SamplingParams = SamplingParams()
    priority: int = 0  # larger runs first
    timeout_ms: TimeoutMs
    destination: DecodeDestination | None = None  # None: prefill only (KV stays cached here)
    # True: the destination comes later, in a DestinationNotice (the reservation on the
    # decode worker runs while this prompt computes); the push waits for it.
    destination_follows: bool = False
    traceparent: Traceparent | None = None

    def __post_init__(self) -> None:
        if self.destination_follows and self.destination is not None:
            raise ValueError("a destination and destination_follows: pick one")


class DestinationNotice(Message, tag="destination_notice", frozen=True, kw_only=True):
    """Gateway → prefill: where the KV of a request sent with `destination_follows` goes."""

    request_id: Id
    destination: DecodeDestination


class DestinationAck(Message, tag="destination_ack", frozen=True, kw_only=True):
    request_id: Id
    # False: no such prefill here yet; the notice is held for a while in case the request
    # is still on its way (two calls need not be handled in the order they were sent).
    waiting: bool


class PrefillResult(Message, tag="prefill_result", frozen=True, kw_only=True):
    """Prefill → gateway, sent as soon as the first token is sampled."""

    request_id: Id
    first_token_id: int
    first_logprob: TokenLogprob | None = None
    num_prompt_tokens: NonNegInt
    num_cached_tokens: NonNegInt  # prompt tokens whose KV came from a prefix cache
    transfer_status: TransferStatus
    finish_reason: FinishReason | None = None  # set when the first token already ends it
    num_steps: NonNegInt = 0  # engine steps of the prefill (its chunks)
    # How long it waited in the worker's queue before its first chunk was scheduled (the
    # rest of the prefill stage is compute); None: not reported.
    queue_ms: NonNegFloat | None = None


class TransferResult(Message, tag="transfer_result", frozen=True, kw_only=True):
    """Prefill → gateway: the KV handoff of one request has ended (D learns it from its KV
    receiver)."""

    request_id: Id
    destination_worker_id: WorkerId
    destination_epoch: NonNegInt
    status: TransferStatus
    num_blocks_sent: NonNegInt = 0
    num_bytes_sent: NonNegInt = 0
    error: Text | None = None
    # What the push cost (worker/kv_push.py): its copy units (one per layer, K or V and run
    # of blocks consecutive on both sides), the time spent posting them (announcing the
    # transfer and queueing each layer) and the time from the last post until it landed.
    num_descriptors: NonNegInt = 0
    post_ms: NonNegFloat = 0.0
    wire_ms: NonNegFloat = 0.0


class DecodeRequest(Message, tag="decode_request", frozen=True, kw_only=True):
    """Gateway → decode: join the decode batch and stream tokens.

    With `first_token_id` set, the prompt's KV was pushed into the reservation made for
    `request_id`; without it, the decode worker prefills the prompt itself (short prompts).
    `resume_token_ids` (local prefill only): the request continues after this output,
    already delivered to the client by another worker (a migrated stream); the worker
    recomputes prompt + output and streams only what follows.
    """

    request_id: Id
    prompt_token_ids: TokenIds
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    timeout_ms: TimeoutMs
    first_token_id: int | None = None
    epoch: NonNegInt | None = None  # the reservation's epoch; a mismatch is STALE_EPOCH
    resume_token_ids: TokenIds = []
    traceparent: Traceparent | None = None
    # Its tier's time-per-output-token target, which a worker holding TPOT keeps its steps
    # within while the request decodes (engine/step_budget.py); None: no target.
    tpot_ms: Annotated[float, msgspec.Meta(gt=0, le=3_600_000)] | None = None

    @property
    def is_local_prefill(self) -> bool:
        return self.first_token_id is None

    @property
    def tpot_s(self) -> float | None:
        return None if self.tpot_ms is None else self.tpot_ms / 1000


class TokenFrame(Message, tag="token_frame", frozen=True, kw_only=True):
    """Decode → gateway: the tokens produced since the previous frame."""

    request_id: Id
    token_ids: TokenIds
    text: Text = ""  # the tokens' text; "" when `texts` (one per token id, in order) is set
    texts: Annotated[list[Text], msgspec.Meta(max_length=MAX_TOKENS_PER_MESSAGE)] | None = None
    logprobs: Annotated[list[TokenLogprob], msgspec.Meta(max_length=MAX_TOKENS_PER_MESSAGE)] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the last frame


class AbortRequest(Message, tag="abort_request", frozen=True, kw_only=True):
    """Gateway → worker: stop the request and free its blocks; unknown ids are not an error."""

    request_id: Id
    reason: Text = ""


class AbortResponse(Message, tag="abort_response", frozen=True, kw_only=True):
    request_id: Id
    found: bool
    # Tokens of the request's decode stream sent when the abort arrived; none are sent after.
    num_tokens_sent: NonNegInt = 0


class RoleChangeRequest(Message, tag="role_change_request", frozen=True, kw_only=True):
    """Operator → worker: take `role` from now on. Work the new role forbids is refused at
    once; what is in flight gets `drain_timeout_ms` to finish, then is aborted (the gateway
    retries or migrates it); then the role is published under a new epoch."""

    role: Role
    drain_timeout_ms: TimeoutMs = 30_000


class RoleChangeResponse(Message, tag="role_change_response", frozen=True, kw_only=True):
    role: Role
    epoch: NonNegInt
    num_aborted: NonNegInt = 0  # in-flight work the drain timeout cut


class ErrorFrame(Message, tag="error_frame", frozen=True, kw_only=True):
    request_id: Id | None = None
    code: ErrorCode
    message: Text
    retryable: bool = False


# ---------------------------------------------------------------- workers -> Redis


class WorkerInfo(Message, tag="worker_info", frozen=True, kw_only=True):
    """A worker's registry entry; `epoch` is assigned by Redis at every start, `binding` by
    the worker (its publisher) whenever a field changes."""

    worker_id: WorkerId
    role: Role
    model: Annotated[str, msgspec.Meta(max_length=1024)]
    control_url: Annotated[str, msgspec.Meta(max_length=1024)]
    kv_address: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    device: Annotated[str, msgspec.Meta(max_length=256)] = "cpu"
    num_kv_blocks: NonNegInt
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    max_num_batched_tokens: NonNegInt = 0
    epoch: NonNegInt = 0
    started_unix_ms: NonNegInt = 0
    pid: NonNegInt = 0  # the worker's process id on its host (0: not told)
    kv_bytes_per_token: NonNegInt = 0  # KV of one token over all layers (0: not told)
    kv_dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""  # KV pool's; a handoff needs one
    sm_share_percent: Annotated[int, msgspec.Meta(ge=0, le=100)] = 0  # CUDA MPS share; 0: none
    draining: bool = False  # still serving what it has; route nothing new here
    # A MAC of every other field with the cluster's registry key (protocol/cluster_secret.py):
    # the gateway and the agent ignore an entry whose binding does not verify. b"": unbound
    # (a cluster without a token).
    binding: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class LoadReport(Message, tag="load_report", frozen=True, kw_only=True):
    """A worker's load as it publishes it to Redis, stamped with its incarnation."""

    worker_id: WorkerId
    epoch: NonNegInt
    load: WorkerLoad = WorkerLoad()
    updated_unix_ms: NonNegInt = 0


class PrefixIndexEvent(Message, tag="prefix_index_event", frozen=True, kw_only=True):
    """Changes to one worker's prefix cache, as chained block hashes.

    `reset`: drop every entry of this worker before applying `inserted` (a new epoch, or a
    full republish after Redis lost state). Applied in order: reset, evicted, inserted.
    """

    worker_id: WorkerId
    epoch: NonNegInt
    inserted: BlockHashes = []
    evicted: BlockHashes = []
    reset: bool = False


# ---------------------------------------------------------------- unions and codecs

PrefillResponseFrame = Union[PrefillResult, TransferResult, ErrorFrame]
DecodeResponseFrame = Union[TokenFrame, ErrorFrame]
AnyMessage = Union[
    ReserveRequest, ReserveResponse, PrefillRequest, PrefillResult, TransferResult,
    DestinationNotice, DestinationAck, DecodeRequest, TokenFrame, AbortRequest, AbortResponse, ErrorFrame, RoleChangeRequest,
    RoleChangeResponse, WorkerInfo, LoadReport, PrefixIndexEvent]
