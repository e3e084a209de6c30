"""The gateway's Prometheus metrics, rendered in the text exposition format (names `pdserve_`).

    pdserve_gateway_ttft_seconds{tier}            histogram: backend start -> first token
    pdserve_gateway_tpot_seconds{tier}            histogram: mean gap between later tokens
    pdserve_gateway_requests_total{endpoint,status} counter: HTTP answers by status
    pdserve_gateway_completions_total{tier,outcome} counter: finished / failed / aborted
    pdserve_gateway_refusals_total{status,code}   counter: requests answered 429 or 503, by
                                                  the error's code (what ran out)
    pdserve_gateway_slo_requests_total{tier,outcome} counter: every request's one SLO
                                                  outcome (gateway/api/slo_accounting.py): met,
                                                  missed_ttft, missed_tpot, missed_both,
                                                  rejected, shed, failed, aborted
    pdserve_gateway_arrival_ttft_seconds{tier}    histogram: arrival at the gateway -> first
                                                  token (admission queueing included)
    pdserve_gateway_tokens_total{tier}            counter: tokens streamed to clients
    pdserve_gateway_splice_mismatch_total         counter: worker usage disagreed with the
                                                  tokens relayed (should stay 0)
    pdserve_gateway_direct_tokens_total           counter: tokens written to their client from
                                                  the read callback of a channel to a worker
                                                  (gateway/api/stream_writer.py), of tokens_total
    pdserve_gateway_channels                      gauge: open channels to workers
    pdserve_gateway_queue_depth{tier}, pdserve_gateway_running{tier}   gauges, read at scrape
    pdserve_gateway_workers{role}                 gauge: routable workers
    pdserve_gateway_redis_connected               gauge: 1 while registry polls succeed
    pdserve_gateway_limits_shared                 gauge: 1 while admission limits are held in
                                                  Redis for every replica, 0 on the 1/N
                                                  local fallback (gateway/admission/shared_limits.py)
    pdserve_gateway_replicas                      gauge: replicas sharing the limits (the N)

Recording is a few dict operations; nothing here does I/O. One instance per gateway
(owned by the app), so tests get fresh counters.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.num = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.num += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        cumulative = 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            yield f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}'
        yield f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.num}'
        yield f"{name}_sum{{{labels}}} {self.total}"
        yield f"{name}_count{{{labels}}} {self.num}"


class GatewayMetrics:
    def __init__(self, tiers: Iterable[str] = (), slo_outcomes: Iterable[str] = ()) -> None:
        """`tiers` (and `slo_outcomes`): series created at zero, so that the first request
        of a tier is an increase a scraper can see (rate() of a series born at 1 is 0)."""
        self.ttft: defaultdict[str, Histogram] = defaultdict(lambda: Histogram(TTFT_BUCKETS_S))
        self.tpot: defaultdict[str, Histogram] = defaultdict(lambda: Histogram(TPOT_BUCKETS_S))
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.completions: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.tokens: defaultdict[str, int] = defaultdict(int)
        self.num_splice_mismatches = 0
        self.num_direct_tokens = 0
        # Attempts after a worker failed: (phase, kind, "retry" before token 1 | "migration").
        self.retries: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        # Plans chosen: (kind "local" | "split", how "predicted" | "rule", tier).
        self.plans: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.num_workers_marked_dead = 0
        self.refusals: defaultdict[tuple[int, str], int] = defaultdict(int)
        self.slo: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.arrival_ttft: defaultdict[str, Histogram] = defaultdict(
            lambda: Histogram(TTFT_BUCKETS_S))
        outcomes = tuple(slo_outcomes)
        for tier in tiers:
            for series in (self.ttft, self.tpot, self.arrival_ttft, self.tokens):
                series[tier]  # noqa: B018 (creates the zero series)
            for outcome in outcomes:
                self.slo[(tier, outcome)] = 0

    def observe_slo(self, tier: str, outcome: str, arrival_ttft_s: float | None) -> None:
        self.slo[(tier, outcome)] += 1
        if arrival_ttft_s is not None:
            self.arrival_ttft[tier].observe(arrival_ttft_s)

    def observe_refusal(self, status: int, code: str) -> None:
        self.refusals[(status, code)] += 1

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def observe_completion(self, tier: str, outcome: str, ttft_s: float | None,
                           decode_s: float, num_tokens: int) -> None:
        self.completions[(tier, outcome)] += 1
        self.tokens[tier] += num_tokens
        if ttft_s is not None:
            self.ttft[tier].observe(ttft_s)
        if num_tokens > 1:
            self.tpot[tier].observe(decode_s / (num_tokens - 1))

    def observe_plan(self, kind: str, predicted: bool, tier: str) -> None:
        self.plans[(kind, "predicted" if predicted else "rule", tier)] += 1

    def observe_retry(self, phase: str, kind: str, migration: bool) -> None:
        self.retries[(phase, kind, "migration" if migration else "retry")] += 1

    def render(self, gauges: Callable[[], Iterable[tuple[str, str, str, float]]]) -> str:
        """Prometheus text; `gauges` yields (name, help, labels, value) read at scrape time."""
        out: list[str] = []
        for name, help_text, kind, series in (
                ("pdserve_gateway_ttft_seconds", "Time to first token (backend).", "histogram", self.ttft),
                ("pdserve_gateway_tpot_seconds", "Mean time per output token after the first.",
                 "histogram", self.tpot),
                ("pdserve_gateway_arrival_ttft_seconds", "Time to first token from arrival at "
                 "the gateway (admission queueing included).", "histogram", self.arrival_ttft)):
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for tier, hist in sorted(series.items()):
                out += hist.lines(name, f'tier="{tier}"')
        out += _counter("pdserve_gateway_requests_total", "HTTP answers by endpoint and status.",
                        ((f'endpoint="{e}",status="{s}"', n) for (e, s), n in sorted(self.requests.items())))
        out += _counter("pdserve_gateway_completions_total", "Generations by tier and outcome.",
                        ((f'tier="{t}",outcome="{o}"', n) for (t, o), n in sorted(self.completions.items())))
        out += _counter("pdserve_gateway_refusals_total",
                        "Requests answered 429 or 503 (before or after the stream's headers), "
                        "by the error's code: the resource or limit that ran out.",
                        ((f'status="{st}",code="{c}"', n)
                         for (st, c), n in sorted(self.refusals.items())))
        out += _counter("pdserve_gateway_slo_requests_total",
                        "Requests by tier and SLO outcome: met, missed_ttft, missed_tpot, "
                        "missed_both, rejected, shed, failed, aborted.",
                        ((f'tier="{t}",outcome="{o}"', n) for (t, o), n in sorted(self.slo.items())))
        out += _counter("pdserve_gateway_tokens_total", "Tokens streamed to clients.",
                        ((f'tier="{t}"', n) for t, n in sorted(self.tokens.items())))
        out += _counter("pdserve_gateway_retries_total",
                        "Attempts started after a worker failed a request: a retry before "
                        "token 1, a migration after it.",
                        ((f'phase="{p}",kind="{k}",type="{t}"', n)
                         for (p, k, t), n in sorted(self.retries.items())))
        out += _counter("pdserve_gateway_plans_total",
                        "Plans chosen: kind local (the decode worker prefills) or split "
                        "(prefill pool + KV handoff), by prediction or by the token-cost rule.",
                        ((f'kind="{k}",how="{h}",tier="{t}"', n)
                         for (k, h, t), n in sorted(self.plans.items())))
        out += _counter("pdserve_gateway_workers_marked_dead_total",
                        "Workers taken out of routing at once because they could not be "
                        "reached.", (("", self.num_workers_marked_dead),))
        out += _counter("pdserve_gateway_direct_tokens_total",
                        "Tokens written to their client straight from the read callback of "
                        "a channel to a worker, without waking the request's task (of "
                        "tokens_total).", (("", self.num_direct_tokens),))
        out += _counter("pdserve_gateway_splice_mismatch_total",
                        "Generations whose worker usage disagreed with the tokens relayed.",
                        (("", self.num_splice_mismatches),))
        seen: set[str] = set()
        for name, help_text, labels, value in gauges():
            if name not in seen:
                seen.add(name)
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
        return "\n".join(out) + "\n"


def _counter(name: str, help_text: str, series: Iterable[tuple[str, int]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    lines += [f"{name}{{{labels}}} {n}" if labels else f"{name} {n}" for labels, n in series]
    return lines
