"""Wiring for `pdserve bench`: parsed options -> workload, corpus, load runs, reports, files.

Each run gets a fresh RequestPlanner with the same seed, so every rate of a goodput search
sees the same request sequence. The event loop is uvloop where installed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.corpus import Corpus
from bench.goodput import GoodputPoint, SearchParams, format_curve, search_goodput
from bench.loadgen import LoadConfig, fetch_model_id, run_load
from bench.planner import RequestPlanner
from bench.progress import ProgressBar
from bench.report import RunReport, build_report, encode_json, format_table
from bench.slo import SLOTarget, default_slos, parse_slo_arg
from bench.workload import Workload, load_workload

DEFAULT_ATTAINMENT_TARGET = 0.9
MODELS_TIMEOUT_S = 10.0


def resolve_slos(workload: Workload, overrides: list[str]) -> dict[str, SLOTarget]:
    """Defaults, then the workload file, then --slo; every workload tier must end up set."""
    slos = default_slos()
    slos.update(workload.slo)
    for text in overrides:
        tier, target = parse_slo_arg(text)
        slos[tier] = target
    missing = [t for t in workload.tiers if t not in slos]
    if missing:
        raise ValueError(f"no SLO for tier(s) {missing}: add [slo.<tier>] or --slo")
    return slos


def _parse_headers(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    headers = []
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header takes NAME:VALUE, got {pair!r}")
        headers.append((name.strip(), value.strip()))
    return tuple(headers)


@dataclass
class BenchRunner:
    args: argparse.Namespace
    workload: Workload
    slos: dict[str, SLOTarget]
    attainment_target: float
    corpus: Corpus
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchRunner:
        workload = load_workload(args.workload)
        target = (args.attainment_target if args.attainment_target is not None
                  else workload.attainment_target or DEFAULT_ATTAINMENT_TARGET)
        if not 0 < target <= 1:
            raise ValueError(f"--attainment-target must be in (0, 1], got {target}")
        if args.num_requests is not None and args.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        return cls(args=args, workload=workload, slos=resolve_slos(workload, args.slo),
                   attainment_target=target,
                   corpus=Corpus.load(args.tokenizer, tokens_per_word=args.tokens_per_word),
                   headers=_parse_headers(args.header))

    def _config(self, model: str, rate: float | None, concurrency: int | None) -> LoadConfig:
        a = self.args
        return LoadConfig(base_url=a.url, api=a.api, model=model, rate_rps=rate,
                          concurrency=concurrency, arrival=a.arrival, burstiness=a.burstiness,
                          duration_s=a.duration, num_requests=a.num_requests,
                          request_timeout_s=a.request_timeout, seed=a.seed,
                          ignore_eos=a.ignore_eos, temperature=a.temperature,
                          api_key=a.api_key, extra_headers=self.headers)

    async def _model(self) -> str:
        if self.args.model:
            return self.args.model
        return await fetch_model_id(self.args.url, MODELS_TIMEOUT_S, self.args.api_key)

    async def measure(self, model: str, rate: float | None, concurrency: int | None,
                      label: str) -> RunReport:
        config = self._config(model, rate, concurrency)
        progress = ProgressBar(label, config.num_requests, config.duration_s,
                               enabled=not self.args.no_progress)
        result = await run_load(config, RequestPlanner(self.workload, self.corpus,
                                                       self.args.seed), progress)
        return build_report(result, config, self.workload.name, self.slos,
                            self.attainment_target, keep_requests=True)

    def _write(self, payload: bytes) -> None:
        if self.args.output is not None:
            self.args.output.parent.mkdir(parents=True, exist_ok=True)
            self.args.output.write_bytes(payload)
            print(f"wrote {self.args.output}", file=sys.stderr)

    def _plot_dir(self) -> Path | None:
        return self.args.plot

    def _finish_report(self, report: RunReport, stem: str) -> None:
        """Plots need every request; the JSON keeps them only with --save-requests."""
        plot_dir = self._plot_dir()
        if plot_dir is not None:
            from bench.plot import plot_latency_cdfs

            print(f"wrote {plot_latency_cdfs(report, plot_dir, stem)}", file=sys.stderr)
        if not self.args.save_requests:
            report.requests = None

    def run_once(self, rate: float | None, concurrency: int | None) -> int:
        async def main() -> RunReport:
            return await self.measure(await self._model(), rate, concurrency, "bench")

        report = _run_async(main())
        self._finish_report(report, "latency_cdf")
        print(format_table(report))
        self._write(encode_json(report))
        return 0

    def search(self, params: SearchParams) -> int:
        def on_point(point: GoodputPoint) -> None:
            verdict = "pass" if point.passed else "FAIL"
            print(f"rate {point.rate_rps:.3f} req/s: {verdict} "
                  + " ".join(f"{t}={a:.1%}" for t, a in point.attainment_by_tier.items()
                             if a is not None), file=sys.stderr)
            self._finish_report(point.report, f"latency_cdf_rate_{point.rate_rps:.3f}")

        async def main():
            model = await self._model()
            return await search_goodput(
                lambda rate: self.measure(model, rate, None, f"rate {rate:.3f}"),
                params, self.attainment_target, on_point)

        report = _run_async(main())
        print(format_curve(report))
        plot_dir = self._plot_dir()
        if plot_dir is not None:
            from bench.plot import plot_attainment_vs_rate

            print(f"wrote {plot_attainment_vs_rate(report, plot_dir)}", file=sys.stderr)
        self._write(encode_json(report))
        return 0


def _run_async(coro):
    try:
        import uvloop
    except ImportError:  # uvloop does not exist on Windows
        return asyncio.run(coro)
    return uvloop.run(coro)
