"""The Prometheus metrics every worker exports on GET /metrics (names prefixed pdserve_).

Engine-side figures (queue lengths, batch sizes, KV usage, step times, throughput) are
updated from each `StepReport` of the engine thread; handoff figures (KV bytes and seconds
transferred, handoff failures by reason) by the prefill and decode workers themselves.
"""

from __future__ import annotations

import time
from collections import deque

from engine.engine_thread import StepReport
from engine.host_kv_tier import HostTierStats
from protocol.agent_messages import HealthReport
from protocol.worker_load import WorkerLoad
from telemetry.metrics import MetricsRegistry

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
THROUGHPUT_WINDOW_S = 5.0


class WorkerMetrics:
    def __init__(self, registry: MetricsRegistry) -> None:
        self.registry = registry
        self.num_waiting = registry.gauge("pdserve_queue_waiting_requests",
                                          "requests waiting for their first step")
        self.num_running = registry.gauge("pdserve_running_requests",
                                          "requests in the running batch")
        self.batch_size = registry.histogram("pdserve_batch_size",
                                             "requests that produced a token per step",
                                             BATCH_BUCKETS)
        self.step_seconds = registry.histogram(
            "pdserve_step_seconds", "engine step time (overlapped CUDA steps: on the device, "
            "from CUDA events)")
        # Steps that only decoded: comparable across workers whatever their prompt mix (the
        # operations agent's "slow" rule reads these).
        self.decode_step_seconds = registry.histogram(
            "pdserve_decode_step_seconds", "engine step time of steps without prefill")
        # Their wall time too: where the host is slower than the device (a starved CPU, a
        # slow loop), requests wait for it, and device events alone would not show it.
        self.decode_wall_seconds = registry.histogram(
            "pdserve_decode_step_wall_seconds", "wall time of engine steps that only decoded "
            "(host and device: what each running request waits per token)")
        self.decode_step_seqs = registry.counter(
            "pdserve_decode_step_seqs_total", "sequences decoded by steps without prefill")
        self.decode_step_context = registry.counter(
            "pdserve_decode_step_context_tokens_total",
            "tokens attended over by steps without prefill")
        self.kv_blocks_used = registry.gauge("pdserve_kv_blocks_used",
                                             "KV blocks referenced by requests/reservations")
        self.kv_blocks_total = registry.gauge("pdserve_kv_blocks_total", "KV blocks in the pool")
        self.kv_usage = registry.gauge("pdserve_kv_usage_ratio", "used / total KV blocks")
        self.moe_imbalance = registry.gauge(
            "pdserve_moe_expert_imbalance", "the most used expert's tokens over the mean, per "
            "MoE layer, over the last window (1: even)", ["layer"])
        self.moe_hottest = registry.gauge(
            "pdserve_moe_hottest_expert", "the most used expert's id, per MoE layer, over the "
            "last window", ["layer"])
        self.moe_rank_imbalance = registry.gauge(
            "pdserve_moe_rank_imbalance", "with --ep: the busiest rank's tokens over the mean, "
            "per MoE layer, over the rebalancer's last window (1: even)", ["layer"])
        self.moe_rebalances = registry.gauge(
            "pdserve_moe_expert_rebalances", "with --ep: expert placements switched so far "
            "(hot experts given copies on other ranks)")
        self.host_tier_blocks = registry.counter(
            "pdserve_kv_host_tier_blocks_total", "prompt blocks past the device-cached prefix "
            "at admission, by whether the host KV tier held them (hit: reloaded, not "
            "recomputed; miss: computed)", ("outcome",))
        self.host_tier_bytes = registry.counter(
            "pdserve_kv_host_tier_bytes_total", "KV bytes copied to the host tier (offloaded: "
            "evicted prefix blocks) and back to the device (reloaded)", ("direction",))
        self.host_tier_dropped = registry.counter(
            "pdserve_kv_host_tier_dropped_blocks_total", "evicted prefix blocks the host tier "
            "could not keep (every slot busy with a copy or an admission)")
        self.host_reload_seconds = registry.histogram(
            "pdserve_kv_host_tier_reload_seconds", "an admission's copy of its prefix blocks "
            "from the host tier back to the device, queued to done (CUDA: to the first step "
            "that finds it done)")
        self.host_blocks_used = registry.gauge("pdserve_kv_host_blocks_used",
                                               "blocks held by the host KV tier")
        self.host_blocks_total = registry.gauge("pdserve_kv_host_blocks_total",
                                                "the host KV tier's size in blocks (0: off)")
        self._host_tier = HostTierStats(num_host_blocks=0, num_held_blocks=0, num_hit_blocks=0,
                                        num_missed_blocks=0, num_dropped_blocks=0,
                                        offloaded_bytes=0, reloaded_bytes=0)
        self.prefix_hit_tokens = registry.counter(
            "pdserve_prefix_cache_hit_tokens_total", "prompt tokens served from a prefix cache")
        self.prompt_tokens = registry.counter("pdserve_prompt_tokens_total",
                                              "prompt tokens of requests started here")
        self.generated_tokens = registry.counter("pdserve_generated_tokens_total",
                                                 "tokens sampled by this worker")
        self.kv_transfer_bytes = registry.counter(
            "pdserve_kv_transfer_bytes_total", "KV bytes moved by completed transfers",
            ("direction",))
        self.kv_transfer_blocks = registry.counter(
            "pdserve_kv_transfer_blocks_total", "KV blocks moved by completed transfers",
            ("direction",))
        self.kv_transfers = registry.counter(
            "pdserve_kv_transfers_total", "completed KV transfers, by how the bytes moved "
            "(mapped: copied into the receiver's mapped pool; carrier: UCX or TCP)",
            ("direction", "path"))
        self.kv_pushes = registry.counter(
            "pdserve_kv_pushes_total", "completed KV pushes of a prefill worker, by when they "
            "started (layer_events: each layer's copy queued behind its compute, mid-step; "
            "mid_step: announced while the prompt computed, sent after)",
            ("start",))
        self.kv_transfer_seconds = registry.histogram(
            "pdserve_kv_transfer_seconds", "duration of completed KV transfers (a prefill "
            "worker's: the part after the prompt's step ended, at least 0.1 ms)",
            label_names=("direction",))
        self.kv_push_bytes = registry.histogram(
            "pdserve_kv_push_bytes", "bytes of each completed KV push",
            buckets=tuple(float(1 << n) for n in range(16, 34, 2)))  # 64 KiB .. 8 GiB
        self.kv_push_descriptors = registry.histogram(
            "pdserve_kv_push_descriptors", "copy units of each completed KV push (one per "
            "layer, K or V, and run of blocks consecutive on both sides)",
            buckets=(2, 8, 32, 128, 512, 2048, 8192, 32768))
        self.kv_push_phase_seconds = registry.histogram(
            "pdserve_kv_push_phase_seconds", "each completed KV push's time posting its "
            "copies (announce, queue each layer: post) and from the last post until it "
            "landed (wire)", label_names=("phase",))
        self.handoff_failures = registry.counter(
            "pdserve_handoff_failures_total", "handoffs that ended in an error", ("reason",))
        self.requests = registry.counter("pdserve_requests_total", "requests ended, by outcome",
                                         ("outcome",))
        self.aborts = registry.counter("pdserve_aborts_total",
                                       "abort requests received, by whether the request was "
                                       "still known here", ("found",))
        self.reservations = registry.gauge("pdserve_reservations_held",
                                           "reservations waiting for KV or their decode request")
        self.kv_waits = registry.counter(
            "pdserve_kv_waits_total", "reservations that waited in line for free KV blocks, "
            "by outcome (served, timed_out: refused OVERLOADED, cancelled)", ("outcome",))
        self.kv_waiting = registry.gauge("pdserve_kv_waiting",
                                         "reservations waiting in line for free KV blocks now")
        self.warmup_seconds = registry.gauge(
            "pdserve_warmup_seconds", "the start-up warm-up's time (0: none ran)")
        self.graph_capture_seconds = registry.gauge(
            "pdserve_graph_capture_seconds", "the start-up capture of the engine's CUDA "
            "graphs, decode and mixed steps (0: none)")
        self.role_changes = registry.counter("pdserve_role_changes_total",
                                             "role changes of this worker, by new role",
                                             ("role",))
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prefill, decode tokens)
        self.kv_send_bytes_per_s = 0.0  # EWMA over completed pushes of bytes / push time

    def on_step(self, report: StepReport) -> None:
        load = report.load
        self.num_waiting.set(load.num_waiting)
        self.num_running.set(load.num_running)
        self.kv_blocks_used.set(load.num_kv_blocks_used)
        self.kv_blocks_total.set(load.num_kv_blocks_total)
        self.kv_usage.set(load.num_kv_blocks_used / max(1, load.num_kv_blocks_total))
        for layer, (ratio, hottest) in enumerate(zip(load.moe_imbalance, load.moe_hottest)):
            self.moe_imbalance.set(ratio, layer=str(layer))
            self.moe_hottest.set(hottest, layer=str(layer))
        for layer, ratio in enumerate(load.moe_rank_imbalance):
            self.moe_rank_imbalance.set(ratio, layer=str(layer))
        if load.moe_rank_imbalance:
            self.moe_rebalances.set(load.num_expert_rebalances)
        if report.host_tier is not None:
            self._on_host_tier(report.host_tier)
        for seconds in report.host_reload_seconds:
            self.host_reload_seconds.observe(seconds)
        if report.step_s <= 0.0:
            return  # a command, not a step
        timed = report.timed_steps()
        for step in timed:
            self.step_seconds.observe(step.seconds)
            if step.shape.decodes_only:
                self.decode_step_seconds.observe(step.seconds)
                self.decode_step_seqs.inc(step.shape.decode_seqs)
                self.decode_step_context.inc(step.shape.context_tokens)
        if timed and all(s.shape.decodes_only for s in timed):
            self.decode_wall_seconds.observe(report.step_s)
        if report.outputs:
            self.batch_size.observe(len(report.outputs))
        prefill_tokens = decode_tokens = generated = 0
        for out in report.outputs:
            num_new = len(out.new_token_ids)
            generated += num_new
            if out.num_output_tokens == 1 and num_new:  # the prompt's first token
                prefill_tokens += out.num_prompt_tokens - out.num_cached_tokens
            else:
                decode_tokens += num_new
        if generated:
            self.generated_tokens.inc(generated)  # once per step, not per request
        now = time.monotonic()
        self._window.append((now, prefill_tokens, decode_tokens))
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def _on_host_tier(self, stats: HostTierStats) -> None:
        """The tier's counters since start, as increments since the last report."""
        last, self._host_tier = self._host_tier, stats
        self.host_tier_blocks.inc(stats.num_hit_blocks - last.num_hit_blocks, outcome="hit")
        self.host_tier_blocks.inc(stats.num_missed_blocks - last.num_missed_blocks,
                                  outcome="miss")
        self.host_tier_bytes.inc(stats.offloaded_bytes - last.offloaded_bytes,
                                 direction="offloaded")
        self.host_tier_bytes.inc(stats.reloaded_bytes - last.reloaded_bytes,
                                 direction="reloaded")
        self.host_tier_dropped.inc(stats.num_dropped_blocks - last.num_dropped_blocks)
        self.host_blocks_used.set(stats.num_held_blocks)
        self.host_blocks_total.set(stats.num_host_blocks)

    def health(self, epoch: int, load: WorkerLoad) -> HealthReport:
        """The operations agent's report (protocol/agent_messages.py), from these counters."""
        return HealthReport(
            epoch=epoch, load=load, num_steps=self.step_seconds.count(),
            step_sum_s=self.step_seconds.sum(),
            num_decode_steps=self.decode_step_seconds.count(),
            decode_sum_s=self.decode_step_seconds.sum(),
            num_decode_walls=self.decode_wall_seconds.count(),
            decode_wall_sum_s=self.decode_wall_seconds.sum(),
            decode_seqs=self.decode_step_seqs.value(),
            decode_context=self.decode_step_context.value(),
            num_requests=int(self.requests.total()),
            num_failed=int(self.requests.value(outcome="error")),
            num_kv_waits=int(self.kv_waits.total()),
            num_kv_waiting=int(self.kv_waiting.total()),
            num_transfers_mapped=int(self.kv_transfers.value(direction="sent", path="mapped")),
            num_transfers_carrier=int(self.kv_transfers.value(direction="sent",
                                                              path="carrier")),
            transfer_sum_s=self.kv_transfer_seconds.sum(direction="sent"),
            num_transfer_failures=int(sum(
                n for labels, n in self.handoff_failures.items()
                if labels[0].startswith("transfer"))))

    def tokens_per_s(self) -> tuple[float, float]:
        """(prefill, decode) tokens per second over the last few seconds."""
        if not self._window:
            return 0.0, 0.0
        span = max(time.monotonic() - self._window[0][0], 1.0)
        return (sum(p for _, p, _ in self._window) / span,
                sum(d for _, _, d in self._window) / span)

    def record_started(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prefix_hit_tokens.inc(num_cached_tokens)

    def record_push_cost(self, num_bytes: int, num_descriptors: int, post_s: float,
                         wire_s: float) -> None:
        """A push completed: its size, its copy units, and its time posting them vs on the
        wire (worker/kv_push.py)."""
        self.kv_push_bytes.observe(num_bytes)
        self.kv_push_descriptors.observe(num_descriptors)
        self.kv_push_phase_seconds.observe(post_s, phase="post")
        self.kv_push_phase_seconds.observe(wire_s, phase="wire")

    def record_kv_sent(self, num_bytes: int, seconds: float) -> None:
        """A push completed: the transfer rate the router predicts KV handoffs with."""
        self.kv_transfer_bytes.inc(num_bytes, direction="sent")
        self.kv_transfer_seconds.observe(seconds, direction="sent")
        if seconds > 0 and num_bytes > 0:
            rate = num_bytes / seconds
            self.kv_send_bytes_per_s = rate if self.kv_send_bytes_per_s == 0 else \
                0.8 * self.kv_send_bytes_per_s + 0.2 * rate
