"""The Prometheus text registry: exposition format, labels, histograms."""

from __future__ import annotations

import pytest

from telemetry.metrics import MetricsRegistry, parse_samples


def test_counter_gauge_histogram_render_in_exposition_format() -> None:
    registry = MetricsRegistry()
    sent = registry.counter("pdserve_kv_transfer_bytes_total", "bytes", ("direction",))
    gauge = registry.gauge("pdserve_running_requests", "running")
    hist = registry.histogram("pdserve_step_seconds", "step", buckets=(0.1, 1.0))
    sent.inc(100, direction="sent")
    sent.inc(50, direction="sent")
    gauge.set(3)
    for v in (0.05, 0.5, 5.0):
        hist.observe(v)
    text = registry.render()
    assert "# TYPE pdserve_kv_transfer_bytes_total counter" in text
    samples = parse_samples(text)
    assert samples['pdserve_kv_transfer_bytes_total{direction="sent"}'] == 150
    assert samples["pdserve_running_requests"] == 3
    assert samples['pdserve_step_seconds_bucket{le="0.1"}'] == 1
    assert samples['pdserve_step_seconds_bucket{le="1"}'] == 2
    assert samples['pdserve_step_seconds_bucket{le="+Inf"}'] == 3
    assert samples["pdserve_step_seconds_count"] == 3
    assert samples["pdserve_step_seconds_sum"] == pytest.approx(5.55)


def test_misuse_raises() -> None:
    registry = MetricsRegistry()
    counter = registry.counter("pdserve_x_total", "x", ("reason",))
    with pytest.raises(ValueError, match="labels"):
        counter.inc(1)
    with pytest.raises(ValueError, match="decrease"):
        counter.inc(-1, reason="a")
    with pytest.raises(ValueError, match="already"):
        registry.counter("pdserve_x_total", "x")
    with pytest.raises(ValueError, match="start with"):
        registry.gauge("other_metric", "x")


def test_label_values_are_escaped() -> None:
    registry = MetricsRegistry()
    registry.counter("pdserve_y_total", "y", ("reason",)).inc(reason='a"b\nc')
    assert 'reason="a\\"b\\nc"' in registry.render()
