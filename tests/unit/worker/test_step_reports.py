"""Step reports: what each step cost, by wall time or on the device, reaches the worker's
metrics with its own shape."""

from __future__ import annotations

from engine.engine_thread import StepReport
from engine.host_kv_tier import HostTierStats
from engine.step_shape import StepShape
from engine.step_timer import TimedStep
from protocol.worker_load import WorkerLoad
from telemetry.metrics import MetricsRegistry
from worker.metrics import WorkerMetrics

PREFILL, DECODE = StepShape(512, 0, 0), StepShape(0, 8, 800)


def report(step_s: float, shape: StepShape = PREFILL,
           device_steps: tuple[TimedStep, ...] | None = None) -> StepReport:
    return StepReport([], [], step_s, WorkerLoad(), shape, 0, device_steps)


def test_a_wall_timed_report_is_its_own_step():
    assert report(0.02).timed_steps() == (TimedStep(PREFILL, 0.02),)
    assert report(0.0).timed_steps() == ()  # after a command


def test_a_device_timed_report_gives_the_steps_the_device_finished():
    steps = (TimedStep(PREFILL, 0.031), TimedStep(DECODE, 0.004))
    assert report(0.002, DECODE, steps).timed_steps() == steps
    # None finished since the last report: no sample, not the wall time of the call.
    assert report(0.002, DECODE, ()).timed_steps() == ()


def test_metrics_count_each_device_timed_step_with_its_shape():
    registry = MetricsRegistry()
    metrics = WorkerMetrics(registry)
    metrics.on_step(report(0.002, DECODE, (TimedStep(PREFILL, 0.031), TimedStep(DECODE, 0.004),
                                           TimedStep(DECODE, 0.005))))
    metrics.on_step(report(0.001, DECODE, ()))
    assert metrics.step_seconds.count() == 3
    assert metrics.decode_step_seconds.count() == 2
    assert metrics.decode_step_seqs.value() == 16
    text = registry.render()
    assert "pdserve_decode_step_seconds_sum 0.009" in text, text


def test_metrics_count_the_host_tier_from_its_counters_since_start():
    def tier(hit: int, miss: int, offloaded: int, held: int) -> HostTierStats:
        return HostTierStats(num_host_blocks=64, num_held_blocks=held, num_hit_blocks=hit,
                             num_missed_blocks=miss, num_dropped_blocks=0,
                             offloaded_bytes=offloaded, reloaded_bytes=hit * 1000)

    registry = MetricsRegistry()
    metrics = WorkerMetrics(registry)
    for stats, reloads in ((tier(0, 4, 0, 0), ()), (tier(3, 4, 8000, 8), (0.002, 0.004)),
                           (tier(5, 6, 8000, 8), (0.003,))):
        metrics.on_step(StepReport([], [], 0.01, WorkerLoad(), PREFILL, 0, None, stats, reloads))
    metrics.on_step(report(0.01))  # a report without a tier changes nothing
    assert metrics.host_tier_blocks.value(outcome="hit") == 5
    assert metrics.host_tier_blocks.value(outcome="miss") == 6
    assert metrics.host_tier_bytes.value(direction="reloaded") == 5000
    assert metrics.host_tier_bytes.value(direction="offloaded") == 8000
    text = registry.render()
    assert "pdserve_kv_host_blocks_used 8" in text and "pdserve_kv_host_blocks_total 64" in text
    assert metrics.host_reload_seconds.count() == 3
    assert "pdserve_kv_host_tier_reload_seconds_sum 0.009" in text, text


def test_metrics_count_the_wall_time_of_calls_that_only_decoded():
    # A host slower than its device (here 0.5 s a call, the device 4 ms a step) shows in
    # the wall time of decode-only calls; calls with a prefill or no finished step do not count.
    metrics = WorkerMetrics(MetricsRegistry())
    metrics.on_step(report(0.5, DECODE, (TimedStep(DECODE, 0.004),)))
    metrics.on_step(report(0.5, DECODE, (TimedStep(DECODE, 0.004), TimedStep(DECODE, 0.004))))
    metrics.on_step(report(0.5, DECODE, (TimedStep(PREFILL, 0.03), TimedStep(DECODE, 0.004))))
    metrics.on_step(report(0.5, DECODE, ()))
    health = metrics.health(0, WorkerLoad())
    assert (health.num_decode_walls, health.decode_wall_sum_s) == (2, 1.0)
    assert health.num_decode_steps == 4
