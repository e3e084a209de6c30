"""The agent's P/D rebalancer against simulated traffic, GPU-free: scenarios run on the
simulated cluster of benchmarks/agent_sim_cluster.py, which calls the real policy
(agent/rebalance.py). Deterministic for a seed; progress on stderr, a Markdown table on
stdout (and every figure and move with --json).

Scenarios (6 workers unless --workers says otherwise):
    shift    chat for 120 s, then long-doc for 180 s, from a split made for chat (2 prefill +
             4 decode); with and without the rebalancer. Target: the new split serves
             within 60 s of the shift.
    steady   600 s of chat on the chat split, then 600 s of long-doc on a long-doc split
             (3 + 3). Target: no role change.
    failure  long-doc on 3 + 3; w-0 (prefill) dies at 60 s and is back at 180 s. Target: no
             role ever without a routable worker, and no move undone.
What is modelled and what is not: docs/agent_simulation.md.

    python -m benchmarks.agent_sim [--scenario all] [--seed 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agent.rebalance import RebalanceConfig, RoleMove
from benchmarks.agent_sim_cluster import Hardware, Request, Scenario, Simulation, Traffic

SCENARIOS = ("shift", "steady", "failure")


@dataclass(frozen=True, slots=True)
class PhaseStats:
    num_requests: int
    num_done: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_ms: float
    tpot_p90_ms: float


@dataclass(frozen=True, slots=True)
class RunResult:
    scenario: str
    rebalancer: bool
    split_start: tuple[int, int]  # routable (prefill, decode) workers at the first tick
    split_end: tuple[int, int]  # ... and at the last one
    min_routable: int  # the fewest routable workers a role had at any tick
    moves: tuple[tuple[float, RoleMove], ...]  # (decided at s, move)
    num_reversals: int  # moves that undo the one before
    first_move_after_shift_s: float | None  # decided then; it serves drain_s later
    phases: dict[str, PhaseStats]
    target: str
    met: bool | None  # None: a baseline, no target


def scenarios(names: set[str], args: argparse.Namespace) -> list[tuple[Scenario, bool]]:
    """(scenario, rebalancer on), in the order they run."""
    chat = Traffic("chat", args.chat_rate, 200, 300)
    doc = Traffic("long-doc", args.long_doc_rate, 6000, 50)
    n, p, lp = args.workers, args.prefill_workers, args.long_doc_prefill_workers
    shift = Scenario("shift", ((chat, 120.0), (doc, 180.0)), n, p)
    runs = {"shift": [(shift, True), (shift, False)],
            "steady": [(Scenario("steady-chat", ((chat, args.steady_s),), n, p), True),
                       (Scenario("steady-long-doc", ((doc, args.steady_s),), n, lp), True)],
            "failure": [(Scenario("failure", ((doc, 300.0),), n, lp, ((0, 60.0, 180.0),)), True)]}
    return [run for name in SCENARIOS if name in names for run in runs[name]]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else math.nan


def phase_stats(requests: list[Request]) -> PhaseStats:
    ttft, tpot = [], []
    for r in requests:
        if r.first_token_s is not None and r.done_s is not None:
            ttft.append(r.first_token_s - r.arrival_s)
            tpot.append((r.done_s - r.first_token_s) * 1000 / (r.output - 1))
    return PhaseStats(len(requests), len(ttft), percentile(ttft, 0.5), percentile(ttft, 0.9),
                      percentile(tpot, 0.5), percentile(tpot, 0.9))


def simulate(scenario: Scenario, on: bool, hw: Hardware, cfg: RebalanceConfig,
             period_s: float, tick_s: float, seed: int) -> RunResult:
    sim = Simulation(scenario, hw, cfg if on else None, period_s, tick_s, seed).run()
    phases = {traffic.name: phase_stats([r for r in sim.requests if r.phase == traffic.name])
              for traffic, _ in scenario.phases}
    shift_s = scenario.phases[0][1] if len(scenario.phases) > 1 else math.inf
    first = next((t - shift_s for t, _ in sim.moves if t >= shift_s), None)
    reversals = sum(a.from_role == b.to_role for (_, a), (_, b) in zip(sim.moves, sim.moves[1:]))
    least = min(min(s[1], s[2]) for s in sim.splits)
    if not on:
        target, met = "(baseline)", None
    elif scenario.name == "shift":
        target = "new split serving within 60 s of the shift"
        met = first is not None and first + hw.drain_s <= 60
    elif scenario.failures:
        target, met = "no role left without a worker, no reversal", least >= 1 and not reversals
    else:
        target, met = "0 role changes", not sim.moves
    return RunResult(scenario.name, on, sim.splits[0][1:], sim.splits[-1][1:], least,
                     tuple(sim.moves), reversals, first, phases, target, met)


def markdown(results: list[RunResult], caption: str, drain_s: float) -> str:
    def row(*cells: object) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    lines = [caption, "", row("scenario", "rebalancer", "split P+D start → end", "role changes",
                              "reversals", "first change after the shift", "target"),
             "|" + "---|" * 7]
    for s in results:
        t, on = s.first_move_after_shift_s, "on" if s.rebalancer else "off"
        lines.append(row(s.scenario, on, "{}+{} → {}+{}".format(*s.split_start, *s.split_end),
                         len(s.moves), s.num_reversals, "-" if t is None else
                         f"decided +{t:.0f} s, serving +{t + drain_s:.0f} s",
                         s.target + ("" if s.met is None else ": met" if s.met else ": MISSED")))
    lines += ["", row("scenario", "rebalancer", "phase", "requests (done)", "TTFT p50 s",
                      "TTFT p90 s", "TPOT p50 ms", "TPOT p90 ms"), "|" + "---|" * 8]
    lines += [row(s.scenario, "on" if s.rebalancer else "off", name,
                  f"{p.num_requests} ({p.num_done})", f"{p.ttft_p50_s:.2f}", f"{p.ttft_p90_s:.2f}",
                  f"{p.tpot_p50_ms:.1f}", f"{p.tpot_p90_ms:.1f}")
              for s in results for name, p in s.phases.items()]
    lines += ["", "Role changes (decided at t; the worker serves its new role after the drain):"]
    lines += [f"- {s.scenario}, t = {t:.0f} s: {m.worker_id} {m.from_role} → {m.to_role}: "
              f"{m.reason}" for s in results for t, m in s.moves] or ["- none"]
    return "\n".join(lines)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


OPTIONS: tuple[tuple[str, type, object, str], ...] = (
    ("--scenario", str, "all", "comma-separated: shift (chat 120 s, then long-doc 180 s; with "
     "and without the rebalancer), steady (chat 600 s, then long-doc 600 s), failure "
     "(long-doc 300 s; w-0 dies at 60 s, is back at 180 s), or all"),
    ("--seed", int, 1, "seeds arrivals and lengths: the same seed gives the same table"),
    ("--workers", int, 6, "workers in all"),
    ("--prefill-workers", int, 2, "of those, prefill at the start of shift and steady-chat "
     "(the others decode)"),
    ("--long-doc-prefill-workers", int, 3, "the same, for steady-long-doc and failure"),
    ("--chat-rate", float, 10.0, "chat requests/s (Poisson; prompts 100-300, outputs 150-450)"),
    ("--long-doc-rate", float, 3.2, "long-doc requests/s (prompts 3000-9000, outputs 25-75)"),
    ("--steady-s", float, 600.0, "simulated seconds of each steady run"),
    ("--prefill-tokens-per-s", float, Hardware().prefill_tokens_per_s,
     "prompt tokens a prefill worker prefills per second"),
    ("--drain-s", float, Hardware().drain_s,
     "how long a role change takes (the worker takes nothing new meanwhile)"),
    ("--tick-s", float, 1.0, "how often the agent samples the pools (simulated seconds)"),
    ("--rebalance-period-s", float, 10.0, "how often it asks the policy for a move"),
    ("--sustain-s", float, RebalanceConfig().sustain_s,
     "RebalanceConfig.sustain_s: how long an imbalance must hold, in every sample"),
    ("--cooldown-s", float, RebalanceConfig().cooldown_s,
     "RebalanceConfig.cooldown_s: no move within this long of the last one"),
    ("--json", Path, None, "also write every run's figures and moves to this file"))


def caption(args: argparse.Namespace, hw: Hardware, cfg: RebalanceConfig) -> str:
    return (f"Simulated by `python -m benchmarks.agent_sim` (seed {args.seed}): {args.workers} "
            f"workers; prefill {hw.prefill_tokens_per_s:g} tokens/s per worker; a decode step "
            f"{hw.decode_base_s * 1e3:g} ms + {hw.decode_per_seq_s * 1e3:g} ms per sequence, at "
            f"most {hw.max_batch} sequences and {hw.kv_tokens} KV tokens per worker; KV "
            f"transfer {hw.transfer_s * 1e3:g} ms; a role change drains {hw.drain_s:g} s. chat "
            f"{args.chat_rate:g} req/s, prompts ~200, outputs ~300 tokens; long-doc "
            f"{args.long_doc_rate:g} req/s, prompts ~6000, outputs ~50 (Poisson; lengths "
            f"uniform within +-50 %). Policy: agent/rebalance.py, sustain_s {cfg.sustain_s:g}, "
            f"cooldown_s {cfg.cooldown_s:g}, other RebalanceConfig defaults, asked every "
            f"{args.rebalance_period_s:g} s. Latencies: every request, to its end.")


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_sim", description=__doc__,
                                     formatter_class=_Help)
    for flag, kind, default, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    names = {n.strip() for n in args.scenario.split(",")}
    names = set(SCENARIOS) if "all" in names else names
    if not names <= set(SCENARIOS):
        parser.error(f"unknown scenario(s) in {args.scenario!r}")
    hw = Hardware(prefill_tokens_per_s=args.prefill_tokens_per_s, drain_s=args.drain_s)
    cfg = RebalanceConfig(sustain_s=args.sustain_s, cooldown_s=args.cooldown_s)
    results = []
    for scenario, on in scenarios(names, args):
        started = time.process_time()
        results.append(r := simulate(scenario, on, hw, cfg, args.rebalance_period_s,
                                     args.tick_s, args.seed))
        print(f">> {scenario.name}, rebalancer {'on' if on else 'off'}: {len(r.moves)} role "
              f"change(s), {time.process_time() - started:.2f} s CPU", file=sys.stderr)
    print(markdown(results, caption(args, hw, cfg), hw.drain_s))
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
