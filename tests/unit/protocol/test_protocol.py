"""Wire messages: round trips, version fencing, decode-time limits, the sampling mirror."""

from __future__ import annotations

import msgspec
import pytest

from protocol.messages import (AbortRequest, AbortResponse, AnyMessage, DecodeDestination,
                               DecodeRequest, DestinationAck, DestinationNotice, ErrorCode,
                               ErrorFrame, FinishReason, LoadReport, MessageDecoder,
                               MessageTooLargeError, PrefillRequest, PrefillResponseFrame,
                               PrefillResult, PrefixIndexEvent, ProtocolError, ProtocolVersionError,
                               ReserveRequest, ReserveResponse, Role, TokenFrame, TokenLogprob,
                               TransferResult, TransferStatus, Usage, WorkerInfo, decode, encode)
from protocol.sampling_params import SamplingParams
from protocol.worker_load import WorkerLoad

DEST = DecodeDestination(worker_id="decode-0", epoch=4, kv_address="ucx://10.0.0.2:7000",
                         block_ids=[9, 3, 12], num_prefix_blocks_held=1)

EXAMPLES = [
    ReserveRequest(request_id="r", prompt_token_ids=[1, 2, 3], timeout_ms=200),
    ReserveResponse(request_id="r", destination=DEST),
    PrefillRequest(request_id="r", prompt_token_ids=[1, 2], timeout_ms=900, priority=2,
                   sampling=SamplingParams(temperature=0.0, stop=("\n",), logprobs=2),
                   destination=DEST),
    PrefillResult(request_id="r", first_token_id=42, first_logprob=TokenLogprob(42, -0.1, [(7, -2.5)]),
                  num_prompt_tokens=2, num_cached_tokens=0, transfer_status=TransferStatus.PENDING),
    TransferResult(request_id="r", destination_worker_id="decode-0", destination_epoch=4,
                   status=TransferStatus.DONE, num_blocks_sent=2, num_bytes_sent=1 << 20),
    DecodeRequest(request_id="r", prompt_token_ids=[1, 2], timeout_ms=5000, first_token_id=42,
                  epoch=4),
    TokenFrame(request_id="r", token_ids=[5, 6], text="hi", finish_reason=FinishReason.STOP,
               usage=Usage(num_prompt_tokens=2, num_completion_tokens=3, num_cached_tokens=1)),
    AbortRequest(request_id="r", reason="client disconnected"),
    AbortResponse(request_id="r", found=True),
    ErrorFrame(request_id="r", code=ErrorCode.STALE_EPOCH, message="decode-0 restarted"),
    WorkerInfo(worker_id="prefill-1", role=Role.PREFILL, model="llama", control_url="http://h:1",
               kv_address="ucx://h:2", num_kv_blocks=1000, block_size=16, epoch=3),
    LoadReport(worker_id="prefill-1", epoch=3, updated_unix_ms=17,
               load=WorkerLoad(num_running=4, num_kv_blocks_used=10, num_kv_blocks_total=1000,
                               prefill_tokens_per_s=1.5e4)),
    PrefixIndexEvent(worker_id="prefill-1", epoch=3, inserted=[2**63 + 1, -7], evicted=[5],
                     reset=True),
    PrefillRequest(request_id="r", prompt_token_ids=[1, 2], timeout_ms=900,
                   destination_follows=True),
    DestinationNotice(request_id="r", destination=DEST),
    DestinationAck(request_id="r", waiting=False),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_the_union(message: msgspec.Struct) -> None:
    assert MessageDecoder(AnyMessage).decode(encode(message)) == message
    assert decode(encode(message), type(message)) == message


def test_local_prefill_is_a_decode_request_without_first_token() -> None:
    assert DecodeRequest(request_id="r", prompt_token_ids=[1], timeout_ms=1).is_local_prefill
    assert not EXAMPLES[5].is_local_prefill


def test_wrong_message_type_for_an_endpoint_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="PrefillRequest"):
        decode(encode(EXAMPLES[0]), PrefillRequest)
    frames = MessageDecoder(PrefillResponseFrame)
    assert frames.decode(encode(EXAMPLES[4])) == EXAMPLES[4]  # a TransferResult, whole
    with pytest.raises(ProtocolError):
        frames.decode(encode(EXAMPLES[6]))


def test_other_protocol_version_is_named_in_the_error() -> None:
    body = msgspec.msgpack.encode((2, EXAMPLES[0]))
    with pytest.raises(ProtocolVersionError, match="version 2"):
        decode(body, AnyMessage)
    with pytest.raises(ProtocolError, match="envelope"):
        decode(msgspec.msgpack.encode(EXAMPLES[0]), AnyMessage)  # no envelope at all
    with pytest.raises(ProtocolError):
        decode(b"\xc1garbage", AnyMessage)


def test_decode_limits() -> None:
    big = encode(ReserveRequest(request_id="r", prompt_token_ids=list(range(5000)),
                                timeout_ms=1))
    with pytest.raises(MessageTooLargeError):
        MessageDecoder(ReserveRequest, max_bytes=1000).decode(big)
    assert MessageDecoder(ReserveRequest, max_bytes=len(big)).decode(big).prompt_token_ids[-1] == 4999
    with pytest.raises(ProtocolError, match="worker_id"):  # ids end up in Redis keys
        decode(encode(LoadReport(worker_id="a:b c", epoch=1)), LoadReport)
    with pytest.raises(ProtocolError, match="xxxxx_request"):
        decode(encode(AbortRequest(request_id="r")).replace(b"abort_request", b"xxxxx_request"),
               AnyMessage)  # unknown tag
    with pytest.raises(ProtocolError, match="timeout_ms"):
        decode(msgspec.msgpack.encode(
            (1, {"type": "prefill_request", "request_id": "r", "prompt_token_ids": [1]})),
            AnyMessage)  # a required field missing
    bad_dest = msgspec.structs.replace(DEST, num_prefix_blocks_held=1)
    raw = msgspec.msgpack.decode(encode(ReserveResponse(request_id="r", destination=bad_dest)))
    raw[1]["destination"]["num_prefix_blocks_held"] = 4  # more held than reserved
    with pytest.raises(ProtocolError, match="num_prefix_blocks_held"):
        decode(msgspec.msgpack.encode(raw), ReserveResponse)
    raw[1]["destination"]["num_prefix_blocks_held"] = 1
    assert decode(msgspec.msgpack.encode(raw), ReserveResponse).destination == bad_dest


def test_sampling_params_cross_the_wire_unchanged_and_are_validated_on_decode() -> None:
    params = SamplingParams(max_tokens=9, temperature=0.0, top_k=5, seed=3, stop=("a", "b"),
                            stop_token_ids=(2,), logprobs=1, min_tokens=2)
    wire = decode(encode(PrefillRequest(request_id="r", prompt_token_ids=[1], timeout_ms=1,
                                        sampling=params)), PrefillRequest)
    assert wire.sampling == params
    assert wire.sampling.stop == ("a", "b") and wire.sampling.stop_token_ids == (2,)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    # A peer that skips the constructor's checks is caught while decoding.
    raw = msgspec.msgpack.decode(encode(PrefillRequest(request_id="r", prompt_token_ids=[1],
                                                       timeout_ms=1)))
    raw[1]["sampling"]["top_p"] = 0.0
    with pytest.raises(ProtocolError, match="top_p"):
        decode(msgspec.msgpack.encode(raw), PrefillRequest)


def test_a_prefill_request_names_its_destination_or_says_it_follows_not_both() -> None:
    with pytest.raises(ValueError, match="pick one"):
        PrefillRequest(request_id="r", prompt_token_ids=[1], timeout_ms=9, destination=DEST,
                       destination_follows=True)
    raw = msgspec.msgpack.decode(encode(EXAMPLES[2]))  # a PrefillRequest with a destination
    raw[1]["destination_follows"] = True
    with pytest.raises(ProtocolError, match="pick one"):
        decode(msgspec.msgpack.encode(raw), PrefillRequest)
    raw = msgspec.msgpack.decode(encode(DestinationNotice(request_id="r", destination=DEST)))
    del raw[1]["destination"]
    with pytest.raises(ProtocolError, match="destination"):
        decode(msgspec.msgpack.encode(raw), DestinationNotice)
