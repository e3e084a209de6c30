"""Reliability under overload and under faults, on whole `pdserve up` clusters.

    python -m benchmarks.reliability overload [--up-args "..."] [--factor 2] [--markdown F]
    python -m benchmarks.reliability soak [--up-args "..."] [--kill-every 20] [--duration 120]

overload: the same cluster twice, one after the other, with the gateway's admission
`static` (a fixed concurrency limit; tiers shed only past their own deadline) and then
`adaptive` (the limit follows the workers' TTFT, lower tiers shed early while the most
urgent one is at risk: gateway/admission/capacity.py). First the static cluster's capacity is
measured (its goodput: the highest rate at which every tier keeps 90% attainment, found by
a search; or --capacity-from throughput: completions/s of a closed loop); both then get
the same seeded open-loop arrivals at --factor times that rate, with the shipped tiers'
TTFT/TPOT targets (or --tiers FILE) as the SLOs. Attainment counts every request sent,
refused ones as misses; the table also shows refusals (429, and how many carried a
Retry-After) and the attainment of the requests that were admitted.

soak: one cluster under steady open-loop load while a worker (decode and prefill in turn)
is killed with SIGKILL every --kill-every seconds; `pdserve up` restarts it and the gateway
retries or migrates the requests it held. Reports requests sent, refused by admission
(429: the load was more than the cluster could serve in its tiers' targets, not a fault),
failed (by kind), kills, and whether the cluster was whole again afterwards; beside the
load, fixed prompts are asked over and over with logprobs, and each answer must have
received exactly the tokens its usage counts (bench/answer_check.py: a token lost or
repeated at a retry or migration shows there). Exits 1 when a request failed, an answer
was broken or a worker did not come back.

Both write a JSON report (--output) and print a markdown table (also --markdown FILE).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import msgspec

from bench.answer_check import CheckRecord, CheckSummary, run_checks, summarize_checks
from bench.corpus import Corpus
from bench.goodput import SearchParams, search_goodput
from bench.loadgen import LoadConfig, RunResult, fetch_model_id, run_load
from bench.planner import RequestPlanner
from bench.progress import ProgressBar
from bench.report import RunReport, attains, build_report, summarize
from bench.slo import SLOTarget
from bench.sse_client import RequestRecord
from bench.workload import Workload, load_workload
from drill.up_cluster import UpCluster


class TierRow(msgspec.Struct):
    mode: str
    tier: str
    sent: int
    completed: int
    refused_429: int
    with_retry_after: int
    other_errors: dict[str, int]
    attainment: float | None        # of every request sent
    admitted_attainment: float | None  # of those not refused
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None


def shipped_slos(tiers_file: str | None) -> dict[str, SLOTarget]:
    from gateway.admission.tiers import load_tier_config

    text = Path(tiers_file).read_text() if tiers_file else None
    config = load_tier_config(text, {})
    return {name: SLOTarget(spec.ttft_ms, spec.tpot_ms) for name, spec in config.tiers.items()}


def tier_rows(mode: str, records: list[RequestRecord], slos: dict[str, SLOTarget]
              ) -> list[TierRow]:
    rows = []
    for tier in sorted({r.tier for r in records}):
        mine = [r for r in records if r.tier == tier]
        refused = [r for r in mine if r.error == "http_429"]
        admitted = [r for r in mine if r.error != "http_429"]
        done = [r for r in mine if r.error is None]
        others: dict[str, int] = {}
        for r in mine:
            if r.error is not None and r.error != "http_429":
                others[r.error] = others.get(r.error, 0) + 1
        ttft = summarize([r.ttft_ms for r in done if r.ttft_ms is not None])
        tpot = summarize([t for r in done if (t := r.tpot_ms) is not None])
        rows.append(TierRow(
            mode, tier, len(mine), len(done), len(refused),
            sum(r.retry_after_s is not None for r in refused), others,
            sum(attains(r, slos) for r in mine) / len(mine) if mine else None,
            sum(attains(r, slos) for r in admitted) / len(admitted) if admitted else None,
            ttft.p50, ttft.p90, tpot.p90))
    return rows


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def overload_table(rows: list[TierRow]) -> str:
    lines = ["| admission | tier | sent | completed | 429 (with Retry-After) | other errors "
             "| attainment (all sent) | attainment (admitted) | TTFT p50 / p90 ms "
             "| TPOT p90 ms |", "|---|---|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in rows:
        errors = ", ".join(f"{k} {v}" for k, v in r.other_errors.items()) or "0"
        lines.append(f"| {r.mode} | {r.tier} | {r.sent} | {r.completed} | {r.refused_429} "
                     f"({r.with_retry_after}) | {errors} | {_pct(r.attainment)} | "
                     f"{_pct(r.admitted_attainment)} | {_ms(r.ttft_p50_ms)} / "
                     f"{_ms(r.ttft_p90_ms)} | {_ms(r.tpot_p90_ms)} |")
    return "\n".join(lines)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workload: Workload = load_workload(args.workload)
        self.corpus = Corpus.load(args.tokenizer)
        self.out_dir = Path(args.out_dir or f"bench-results/reliability-{int(time.time())}")

    def cluster(self, name: str, admission: str) -> UpCluster:
        return UpCluster(self.args.up_args, self.out_dir / f"{name}-up.log",
                         env={"PDSERVE_ADMISSION": admission},
                         ready_timeout_s=self.args.ready_timeout)

    async def load(self, url: str, label: str, rate: float | None = None,
                   concurrency: int | None = None, duration_s: float | None = None
                   ) -> RunResult:
        return (await self.load_with_config(url, label, rate, concurrency, duration_s))[1]

    async def load_with_config(self, url: str, label: str, rate: float | None = None,
                               concurrency: int | None = None, duration_s: float | None = None
                               ) -> tuple[LoadConfig, RunResult]:
        a = self.args
        config = LoadConfig(base_url=url, api=a.api, model=await fetch_model_id(url, 10.0, None),
                            rate_rps=rate, concurrency=concurrency,
                            duration_s=duration_s or a.duration, num_requests=a.max_requests,
                            request_timeout_s=a.request_timeout, seed=a.seed)
        progress = ProgressBar(label, config.num_requests, config.duration_s,
                               enabled=not a.no_progress)
        return config, await run_load(
            config, RequestPlanner(self.workload, self.corpus, a.seed), progress)

    def warm_up(self, url: str) -> None:
        if self.args.warmup > 0:
            asyncio.run(self.load(url, "warm-up", concurrency=4,
                                  duration_s=self.args.warmup))

    def write(self, payload: object, markdown: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"{self.args.command}.json").write_bytes(
            msgspec.json.format(msgspec.json.encode(payload), indent=2))
        print(markdown)
        if self.args.markdown:
            Path(self.args.markdown).write_text(markdown + "\n")
        print(f"wrote {self.out_dir}", file=sys.stderr)


def throughput_rps(result: RunResult, window_s: float) -> float:
    """Requests completed within the sending window, per second (the tail left in flight
    when sending stops is not counted: it would understate a closed loop's rate)."""
    done = [r for r in result.records if r.error is None and r.e2e_ms is not None
            and r.start_s + r.e2e_ms / 1000 <= window_s]
    return len(done) / window_s


def measure_capacity(bench: Bench, url: str, slos: dict[str, SLOTarget]) -> float | None:
    a = bench.args
    if a.capacity_from == "throughput":
        result = asyncio.run(bench.load(url, "capacity", concurrency=a.capacity_concurrency,
                                        duration_s=a.capacity_duration))
        return throughput_rps(result, a.capacity_duration)

    async def run_at(rate: float) -> RunReport:
        config, result = await bench.load_with_config(url, f"goodput {rate:.2f}", rate=rate,
                                                      duration_s=a.capacity_duration)
        return build_report(result, config, bench.workload.name, slos, 0.9)

    report = asyncio.run(search_goodput(
        run_at, SearchParams(start_rate_rps=a.goodput_start, max_runs=a.goodput_runs), 0.9,
        lambda p: print(f"rate {p.rate_rps:.2f}: {'pass' if p.passed else 'fail'} "
                        + " ".join(f"{t} {v:.0%}" for t, v in p.attainment_by_tier.items()
                                   if v is not None), file=sys.stderr)))
    return report.goodput_rps


def run_overload(bench: Bench) -> int:
    a = bench.args
    slos = shipped_slos(a.tiers)
    missing = [t for t in bench.workload.tiers if t not in slos]
    if missing:
        print(f"workload tiers {missing} are not in the gateway's tiers", file=sys.stderr)
        return 2
    rows: list[TierRow] = []
    capacity = a.capacity
    for mode in ("static", "adaptive"):
        with bench.cluster(mode, mode) as cluster:
            cluster.wait_ready()
            bench.warm_up(cluster.url)
            if capacity is None:
                capacity = measure_capacity(bench, cluster.url, slos)
                print(f"capacity ({a.capacity_from}): {capacity} req/s", file=sys.stderr)
                if not capacity:
                    print("no capacity measured (nothing passed or completed)", file=sys.stderr)
                    return 1
            rate = a.factor * capacity
            result = asyncio.run(bench.load(cluster.url, f"{mode} {rate:.2f} req/s", rate=rate))
            rows += tier_rows(mode, result.records, slos)
    assert capacity is not None
    markdown = (f"capacity ({a.capacity_from}) {capacity:.3f} req/s; offered {a.factor:g}x = "
                f"{a.factor * capacity:.3f} req/s for {a.duration:g} s, workload "
                f"{a.workload}, SLOs " + ", ".join(f"{t} {s.ttft_ms:g}/{s.tpot_ms:g} ms"
                                                 for t, s in slos.items()
                                                 if t in bench.workload.tiers)
                + "\n\n" + overload_table(rows))
    bench.write({"capacity_rps": capacity, "factor": a.factor, "rows": rows}, markdown)
    return 0


class SoakReport(msgspec.Struct):
    duration_s: float
    rate_rps: float
    sent: int
    completed: int
    refused_429: int  # admission's answers to overload, not faults
    failed_by_kind: dict[str, int]  # everything else that did not complete
    kills: list[str]
    workers_before: int
    workers_after: int
    answers: CheckSummary | None = None  # tokens billed vs received (answer_check.py)


async def _kill_loop(cluster: UpCluster, every_s: float, kills: list[str]) -> None:
    roles = ("decode", "prefill")
    turn = 0
    while True:
        await asyncio.sleep(every_s)
        workers = await asyncio.to_thread(cluster.workers)
        ready = [w for w in workers if w["state"] == "ready" and w.get("pid")]
        role = roles[turn % len(roles)]
        turn += 1
        victims = sorted((w for w in ready if w["role"] == role), key=lambda w: w["id"]) \
            or ready
        if victims:
            victim = victims[(turn // len(roles)) % len(victims)]
            cluster.kill_worker(victim)
            kills.append(f"{victim['id']} (pid {victim['pid']})")
            print(f"killed {kills[-1]}", file=sys.stderr)


def run_soak(bench: Bench) -> int:
    a = bench.args

    async def soak(cluster: UpCluster) -> tuple[RunResult, list[str], CheckSummary | None]:
        kills: list[str] = []
        checks: list[CheckRecord] = []
        stop = asyncio.Event()
        checker = None
        if a.check_answers:
            model = await fetch_model_id(cluster.url, 10.0, None)
            checker = asyncio.create_task(run_checks(
                cluster.url, model, a.check_tokens, a.request_timeout, stop, checks))
        killer = asyncio.create_task(_kill_loop(cluster, a.kill_every, kills))
        try:
            result = await bench.load(cluster.url, "soak", rate=a.rate)
        finally:
            stop.set()  # the checker ends after its answer in flight
            killer.cancel()
            await asyncio.gather(killer, *([checker] if checker else []),
                                 return_exceptions=True)
        return result, kills, summarize_checks(checks) if a.check_answers else None

    with bench.cluster("soak", "adaptive") as cluster:
        cluster.wait_ready()
        before = len(cluster.workers())
        bench.warm_up(cluster.url)
        result, kills, answers = asyncio.run(soak(cluster))
        deadline = time.monotonic() + a.ready_timeout
        after = 0
        while time.monotonic() < deadline:
            after = sum(w["state"] == "ready" for w in cluster.workers())
            if after >= before:
                break
            time.sleep(1.0)
    failed: dict[str, int] = {}
    for r in result.records:
        if r.error is not None and r.error != "http_429":
            failed[r.error] = failed.get(r.error, 0) + 1
    refused = sum(r.error == "http_429" for r in result.records)
    report = SoakReport(a.duration, a.rate, len(result.records),
                        sum(r.error is None for r in result.records), refused, failed, kills,
                        before, after, answers)
    checked = "-" if answers is None else \
        f"{answers.checked} / {answers.broken} / {answers.failed}"
    markdown = ("| duration s | rate req/s | sent | completed | refused (429) | failed "
                "| workers killed | workers ready before / after "
                "| answers checked / broken / failed |\n"
                "|---:|---:|---:|---:|---:|---|---:|---|---|\n"
                f"| {a.duration:g} | {a.rate:g} | {report.sent} | {report.completed} | "
                f"{refused} | {', '.join(f'{k} {v}' for k, v in failed.items()) or '0'} | "
                f"{len(kills)} | {before} / {after} | {checked} |")
    for wrong in answers.broken_records if answers is not None else ():
        print(f"prompt {wrong.prompt_index} ({'streamed' if wrong.streamed else 'whole'}): "
              f"{wrong.detail}", file=sys.stderr)
    bench.write(report, markdown)
    broken = answers is not None and answers.broken > 0
    return 0 if not failed and after >= before and not broken else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    overload = sub.add_parser("overload", help="static vs adaptive admission at N x capacity")
    soak = sub.add_parser("soak", help="steady load while workers are killed")
    for p in (overload, soak):
        p.add_argument("--up-args", default="", help='extra `pdserve up` options, e.g. '
                       '"--prefill 1 --decode 1 --model /m --device cuda"')
        p.add_argument("--workload", default="mixed",
                       help="bench workload preset or TOML file (default mixed)")
        p.add_argument("--api", choices=("chat", "completions"), default="chat",
                       help="the endpoint the load uses (default chat)")
        p.add_argument("--duration", type=float, default=60.0,
                       help="seconds of load per run (default 60)")
        p.add_argument("--warmup", type=float, default=10.0,
                       help="seconds of discarded closed-loop load first (default 10)")
        p.add_argument("--max-requests", type=int, default=100_000,
                       help="stop sending after this many requests per run")
        p.add_argument("--request-timeout", type=float, default=120.0,
                       help="a request not done by then is a timeout error (default 120)")
        p.add_argument("--seed", type=int, default=0, help="requests and arrivals seed")
        p.add_argument("--tokenizer", default=None,
                       help="tokenizer.json for exact prompt lengths (default: by words)")
        p.add_argument("--ready-timeout", type=float, default=600.0,
                       help="seconds to wait for the cluster (and for it to be whole again)")
        p.add_argument("--out-dir", default=None, help="logs and JSON (default "
                       "bench-results/reliability-<time>)")
        p.add_argument("--markdown", default=None, help="also write the table here")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
    overload.add_argument("--factor", type=float, default=2.0,
                          help="offered load as a multiple of the capacity (default 2)")
    overload.add_argument("--capacity", type=float, default=None,
                          help="capacity in req/s; default: measured first")
    overload.add_argument("--capacity-from", choices=("goodput", "throughput"),
                          default="goodput",
                          help="goodput: the highest rate at which every tier keeps 90%% "
                               "attainment under static admission (a search); throughput: "
                               "completions/s of a closed loop (default goodput)")
    overload.add_argument("--capacity-concurrency", type=int, default=16,
                          help="closed-loop concurrency for --capacity-from throughput "
                               "(default 16)")
    overload.add_argument("--capacity-duration", type=float, default=30.0,
                          help="seconds of each capacity run (default 30)")
    overload.add_argument("--goodput-start", type=float, default=1.0,
                          help="first rate of the goodput search, req/s (default 1)")
    overload.add_argument("--goodput-runs", type=int, default=6,
                          help="runs of the goodput search at most (default 6)")
    overload.add_argument("--tiers", default=None,
                          help="the gateway's tiers file, whose targets are the SLOs "
                               "(default: the built-in tiers)")
    soak.add_argument("--rate", type=float, default=0.5, help="open-loop req/s (default 0.5)")
    soak.add_argument("--kill-every", type=float, default=20.0,
                      help="seconds between worker kills (default 20)")
    soak.add_argument("--check-answers", action=argparse.BooleanOptionalAction, default=True,
                      help="beside the load, ask fixed prompts over and over with logprobs "
                           "and check that each answer received exactly the tokens its "
                           "usage counts (bench/answer_check.py); a token lost or "
                           "repeated fails the run (default on)")
    soak.add_argument("--check-tokens", type=int, default=32,
                      help="max_tokens of the checked answers (default 32)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "overload" and args.tiers:
        args.up_args = f"{args.up_args} --tiers {args.tiers}"
    bench = Bench(args)
    return run_overload(bench) if args.command == "overload" else run_soak(bench)


if __name__ == "__main__":
    sys.exit(main())
