"""Run reports: per-tier and overall figures, the JSON schema, and the terminal table.

JSON schema (SCHEMA_VERSION 1; fields are only ever added, a removal or change of meaning
bumps the version). A run report, `kind = "run"`:

    schema_version, kind, tool, started_at (ISO 8601 UTC), wall_s
    config:  {base_url, api, model, workload, arrival, burstiness, rate_rps | null,
              concurrency | null, duration_s, num_requests_limit | null (no limit),
              request_timeout_s, seed, ignore_eos}
    client:  {cpu_s, cpu_fraction (of one core over wall_s), send_lag_ms: Percentiles}
    attainment_target, meets_target (every tier with requests at or above the target)
    overall, tiers.<tier>: GroupReport
        num_requests, num_completed, num_errors, errors_by_type {kind: count},
        request_throughput_rps, output_tokens_per_s, total_output_tokens (completed only),
        ttft_ms, tpot_ms, itl_ms, e2e_ms: Percentiles {count, mean, p50, p90, p99}
            (completed requests only; null when count is 0),
        slo {ttft_ms, tpot_ms} | null (null for overall), slo_attainment | null
            (share of ALL requests, errors included, that met their tier's SLO)
    requests: [RequestRecord] | null (only with --save-requests)
    sent_for_s: from the first send to the last (the load's real length)
    ended_by_limit: the --num-requests limit, not --duration, ended the sending (then the
        load lasted sent_for_s, not duration_s: a high rate's run is that much shorter)
"""

from __future__ import annotations

import datetime
import math

import msgspec

from bench.loadgen import LoadConfig, RunResult
from bench.slo import SLOTarget, meets_slo
from bench.sse_client import RequestRecord

SCHEMA_VERSION = 1
TOOL = "pdserve bench"


class Percentiles(msgspec.Struct):
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class GroupReport(msgspec.Struct):
    num_requests: int
    num_completed: int
    num_errors: int
    errors_by_type: dict[str, int]
    request_throughput_rps: float
    output_tokens_per_s: float
    total_output_tokens: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    slo: SLOTarget | None
    slo_attainment: float | None


class RunConfigEcho(msgspec.Struct):
    base_url: str
    api: str
    model: str
    workload: str
    arrival: str
    burstiness: float
    rate_rps: float | None
    concurrency: int | None
    duration_s: float
    num_requests_limit: int | None
    request_timeout_s: float
    seed: int
    ignore_eos: bool


class ClientStats(msgspec.Struct):
    cpu_s: float
    cpu_fraction: float
    send_lag_ms: Percentiles


class RunReport(msgspec.Struct):
    schema_version: int
    kind: str
    tool: str
    started_at: str
    wall_s: float
    config: RunConfigEcho
    client: ClientStats
    attainment_target: float
    meets_target: bool
    overall: GroupReport
    tiers: dict[str, GroupReport]
    requests: list[RequestRecord] | None = None
    sent_for_s: float = 0.0
    ended_by_limit: bool = False


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    pos = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def summarize(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(count=0)
    ordered = sorted(values)
    return Percentiles(count=len(ordered), mean=sum(ordered) / len(ordered),
                       p50=percentile(ordered, 50), p90=percentile(ordered, 90),
                       p99=percentile(ordered, 99))


def attains(record: RequestRecord, slos: dict[str, SLOTarget]) -> bool:
    return meets_slo(record.error, record.ttft_ms, record.tpot_ms, slos[record.tier])


def group_report(records: list[RequestRecord], wall_s: float, slos: dict[str, SLOTarget],
                 slo: SLOTarget | None) -> GroupReport:
    completed = [r for r in records if r.error is None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    total_output_tokens = sum(r.output_tokens for r in completed)
    attainment = (sum(attains(r, slos) for r in records) / len(records)) if records else None
    return GroupReport(
        num_requests=len(records), num_completed=len(completed),
        num_errors=len(records) - len(completed), errors_by_type=dict(sorted(errors.items())),
        request_throughput_rps=len(completed) / wall_s if wall_s > 0 else 0.0,
        output_tokens_per_s=total_output_tokens / wall_s if wall_s > 0 else 0.0,
        total_output_tokens=total_output_tokens,
        ttft_ms=summarize([r.ttft_ms for r in completed if r.ttft_ms is not None]),
        tpot_ms=summarize([t for r in completed if (t := r.tpot_ms) is not None]),
        itl_ms=summarize([gap for r in completed for gap in r.itl_ms]),
        e2e_ms=summarize([r.e2e_ms for r in completed if r.e2e_ms is not None]),
        slo=slo, slo_attainment=attainment)


def build_report(result: RunResult, config: LoadConfig, workload_name: str,
                 slos: dict[str, SLOTarget], attainment_target: float,
                 keep_requests: bool = False) -> RunReport:
    """Side-effect free. `slos` must cover every tier present in `result`."""
    missing = {r.tier for r in result.records} - set(slos)
    if missing:
        raise ValueError(f"no SLO for tier(s) {sorted(missing)}; set them with --slo")
    by_tier: dict[str, list[RequestRecord]] = {}
    for record in result.records:
        by_tier.setdefault(record.tier, []).append(record)
    tiers = {tier: group_report(records, result.wall_s, slos, slos[tier])
             for tier, records in sorted(by_tier.items())}
    meets = all(g.slo_attainment is not None and g.slo_attainment >= attainment_target
                for g in tiers.values()) and bool(tiers)
    lags = [(r.start_s - r.scheduled_s) * 1e3 for r in result.records
            if r.scheduled_s is not None]
    started = datetime.datetime.fromtimestamp(result.started_at_unix_s, datetime.UTC)
    return RunReport(
        schema_version=SCHEMA_VERSION, kind="run", tool=TOOL,
        started_at=started.isoformat(timespec="seconds"), wall_s=result.wall_s,
        config=RunConfigEcho(
            base_url=config.base_url, api=config.api, model=config.model,
            workload=workload_name, arrival=config.arrival, burstiness=config.burstiness,
            rate_rps=config.rate_rps, concurrency=config.concurrency,
            duration_s=config.duration_s, num_requests_limit=config.num_requests,
            request_timeout_s=config.request_timeout_s, seed=config.seed,
            ignore_eos=config.ignore_eos),
        client=ClientStats(cpu_s=result.client_cpu_s,
                           cpu_fraction=result.client_cpu_s / result.wall_s
                           if result.wall_s > 0 else 0.0,
                           send_lag_ms=summarize(lags)),
        attainment_target=attainment_target, meets_target=meets,
        overall=group_report(result.records, result.wall_s, slos, None), tiers=tiers,
        requests=result.records if keep_requests else None,
        sent_for_s=max((r.start_s for r in result.records), default=0.0),
        ended_by_limit=(config.num_requests is not None
                        and len(result.records) >= config.num_requests))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(report: RunReport) -> str:
    groups = list(report.tiers.items()) + [("overall", report.overall)]
    load = (f"rate {report.config.rate_rps:g} req/s ({report.config.arrival})"
            if report.config.rate_rps is not None
            else f"concurrency {report.config.concurrency}")
    lines = [f"{report.config.workload} @ {load}, {report.wall_s:.1f}s, "
             f"model {report.config.model}",
             *([f"note: the --num-requests limit ({report.config.num_requests_limit}) ended "
                f"the sending after {report.sent_for_s:.1f} s of the "
                f"{report.config.duration_s:g} s asked"] if report.ended_by_limit else []),
             f"{'tier':<12} {'reqs':>5} {'ok':>5} {'errors':>6} {'req/s':>7} "
             f"{'out tok/s':>9} {'SLO ttft/tpot ms':>17} {'attain':>7}"]
    for name, g in groups:
        slo = f"{g.slo.ttft_ms:g}/{g.slo.tpot_ms:g}" if g.slo else "-"
        attain = "-" if g.slo_attainment is None else f"{g.slo_attainment:.1%}"
        lines.append(f"{name:<12} {g.num_requests:>5} {g.num_completed:>5} {g.num_errors:>6} "
                     f"{g.request_throughput_rps:>7.2f} {g.output_tokens_per_s:>9.1f} "
                     f"{slo:>17} {attain:>7}")
    lines.append(f"{'latency ms':<17} {'p50':>8} {'p90':>8} {'p99':>8} {'mean':>8}")
    for name, g in groups:
        for metric, p in (("TTFT", g.ttft_ms), ("TPOT", g.tpot_ms), ("ITL", g.itl_ms),
                          ("E2E", g.e2e_ms)):
            lines.append(f"{name[:12]:<12} {metric:<4} {_ms(p.p50):>8} {_ms(p.p90):>8} "
                         f"{_ms(p.p99):>8} {_ms(p.mean):>8}")
    if report.overall.errors_by_type:
        lines.append("errors: " + ", ".join(f"{k}={v}" for k, v in
                                            report.overall.errors_by_type.items()))
    verdict = "MEETS" if report.meets_target else "MISSES"
    lines.append(f"{verdict} attainment target {report.attainment_target:.0%} in every tier; "
                 f"client CPU {report.client.cpu_s:.2f}s "
                 f"({report.client.cpu_fraction:.0%} of one core), "
                 f"send lag p99 {_ms(report.client.send_lag_ms.p99)} ms")
    return "\n".join(lines)


def encode_json(report: msgspec.Struct) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2)
