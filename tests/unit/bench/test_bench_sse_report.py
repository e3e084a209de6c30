"""SSE event handling, SLO checks and report figures (pure logic, no network)."""

import pytest

from bench.loadgen import LoadConfig, RunResult, api_root, endpoint_url
from bench.planner import PlannedRequest
from bench.report import build_report, encode_json, format_table, percentile
from bench.slo import SLOTarget, meets_slo, parse_slo_arg
from bench.sse_client import ErrorKind, RequestRecord, StreamFault, StreamState, build_headers


def _chat(text):
    return '{"choices":[{"index":0,"delta":{"content":%s}}]}' % text


def test_chat_stream_timings_and_usage():
    state = StreamState("chat", start_t=10.0)
    assert not state.on_data('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}', 10.05)
    assert not state.on_data(_chat('""'), 10.06)          # empty content: not a token
    assert not state.on_data(_chat('"Hel"'), 10.10)
    assert not state.on_data(_chat('"lo"'), 10.13)
    assert not state.on_data(_chat('"!"'), 10.18)
    assert not state.on_data('{"choices":[],"usage":{"prompt_tokens":7,'
                             '"completion_tokens":4}}', 10.19)
    assert state.on_data("[DONE]", 10.20)
    record = RequestRecord(index=0, class_name="c", tier="t", scheduled_s=None, start_s=0.0)
    state.fill(record)
    assert record.ttft_ms == pytest.approx(100.0)
    assert record.itl_ms == pytest.approx([30.0, 50.0])
    assert record.e2e_ms == pytest.approx(200.0)
    assert (record.output_tokens, record.output_tokens_from_usage) == (4, True)
    assert record.prompt_tokens == 7
    assert record.tpot_ms == pytest.approx((200.0 - 100.0) / 3)


def test_completions_stream_counts_chunks_without_usage():
    state = StreamState("completions", start_t=0.0)
    for i, t in enumerate((0.5, 0.6, 0.7)):
        state.on_data('{"choices":[{"index":0,"text":"w%d"}]}' % i, t)
    state.on_data("[DONE]", 0.7)
    record = RequestRecord(index=0, class_name="c", tier="t", scheduled_s=None, start_s=0.0)
    state.fill(record)
    assert (record.output_tokens, record.output_tokens_from_usage) == (3, False)
    assert record.tpot_ms == pytest.approx(100.0)


@pytest.mark.parametrize("payload,kind", [
    ('{"choices": [', ErrorKind.BAD_JSON),
    ('[1, 2]', ErrorKind.BAD_JSON),
    ('{"error": {"message": "overloaded"}}', ErrorKind.STREAM_ERROR),
])
def test_malformed_events_raise_a_typed_fault(payload, kind):
    with pytest.raises(StreamFault) as info:
        StreamState("chat", 0.0).on_data(payload, 1.0)
    assert info.value.kind == kind


def test_tier_goes_in_the_header_unless_the_class_has_a_key():
    req = PlannedRequest(index=0, class_name="c", tier="interactive", api_key=None,
                         prompt="p", input_len=1, max_tokens=2, prefix_id=None)
    assert build_headers(req, None) == {"x-pdserve-tier": "interactive"}
    assert build_headers(req, "sk-x")["Authorization"] == "Bearer sk-x"
    keyed = PlannedRequest(index=0, class_name="c", tier="batch", api_key="sk-b",
                           prompt="p", input_len=1, max_tokens=2, prefix_id=None)
    assert build_headers(keyed, "sk-x") == {"Authorization": "Bearer sk-b"}


def test_urls_accept_base_with_or_without_v1():
    assert api_root("http://h:1/v1/") == "http://h:1"
    assert endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/v1", "completions") == "http://h:1/v1/completions"


def test_slo_check_and_parsing():
    target = SLOTarget(ttft_ms=250, tpot_ms=50)
    assert meets_slo(None, 250.0, 50.0, target)           # at the target is within it
    assert not meets_slo(None, 250.1, 10.0, target)
    assert not meets_slo(None, 100.0, 50.1, target)
    assert meets_slo(None, 100.0, None, target)           # one-token reply: TTFT only
    assert not meets_slo("http_500", 1.0, 1.0, target)
    assert parse_slo_arg("batch:5000:200") == ("batch", SLOTarget(5000, 200))
    with pytest.raises(ValueError):
        parse_slo_arg("batch:5000")


def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 90) == 3.0


def _record(i, tier, ttft, e2e, tokens, error=None):
    return RequestRecord(index=i, class_name=tier, tier=tier, scheduled_s=i * 0.1,
                         start_s=i * 0.1 + 0.001, ttft_ms=ttft, e2e_ms=e2e,
                         itl_ms=[(e2e - ttft) / (tokens - 1)] * (tokens - 1) if ttft else [],
                         output_tokens=tokens, error=error)


def test_report_per_tier_attainment_errors_and_throughput():
    records = [_record(i, "fast", 100.0, 100.0 + 9 * 20.0, 10) for i in range(8)]
    records.append(_record(8, "fast", 400.0, 580.0, 10))           # TTFT miss
    records.append(_record(9, "fast", None, None, 0, error="http_500"))
    records += [_record(10 + i, "slow", 900.0, 900.0 + 4 * 90.0, 5) for i in range(4)]
    slos = {"fast": SLOTarget(250, 50), "slow": SLOTarget(1000, 100)}
    config = LoadConfig(base_url="http://x", api="chat", model="m", rate_rps=10.0,
                        duration_s=2.0, num_requests=100)
    result = RunResult(records=records, started_at_unix_s=0.0, wall_s=2.0, client_cpu_s=0.5)
    report = build_report(result, config, "w", slos, attainment_target=0.9)
    fast, slow = report.tiers["fast"], report.tiers["slow"]
    assert fast.slo_attainment == pytest.approx(0.8)   # the miss and the error both count
    assert slow.slo_attainment == 1.0
    assert not report.meets_target                     # 0.8 < 0.9 in one tier
    assert fast.errors_by_type == {"http_500": 1}
    assert fast.num_completed == 9 and fast.request_throughput_rps == pytest.approx(4.5)
    assert fast.output_tokens_per_s == pytest.approx(90 / 2.0)
    assert fast.tpot_ms.p50 == pytest.approx(20.0)
    assert report.overall.num_requests == 14
    assert report.overall.slo_attainment == pytest.approx(12 / 14)
    assert report.client.cpu_fraction == pytest.approx(0.25)
    assert report.client.send_lag_ms.p50 == pytest.approx(1.0)
    assert b'"schema_version": 1' in encode_json(report)
    table = format_table(report)
    assert "fast" in table and "80.0%" in table and "http_500=1" in table
    with pytest.raises(ValueError, match="no SLO"):
        build_report(result, config, "w", {"fast": slos["fast"]}, 0.9)
