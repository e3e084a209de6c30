"""The drill's wiring: reach the cluster, find its layout, pick the scenarios, run them,
print and write the table, publish the rows (drill/publisher.py); with `--schedule`, again
every so many seconds. Returns the exit code (0 every row of every round passed, 1 one did
not, 2 the drill could not run)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from bench.answer_check import PROMPTS
from bench.corpus import Corpus
from bench.loadgen import fetch_model_id
from bench.planner import RequestPlanner
from bench.runner import resolve_slos
from bench.workload import load_workload
from drill import processes
from drill.fault import FaultSettings
from drill.publisher import DrillMetrics, DrillPublisher
from drill.row import DrillRow, markdown_table
from drill.runner import Drill, DrillOptions, say
from drill.scenario import Layout, select
from drill.steady_load import SteadyLoad
from drill.target_cluster import TargetCluster
from protocol.agent_messages import FaultRequest
from rpc.errors import ControlError
from state.agent_state import AgentState
from state.redis_state import RedisState, connect

# A prompt of about 600 tokens: long enough that the router hands it off prefill → decode,
# so the answer checks cross a KV transfer too (stall-transfer's victim).
LONG_PROMPT = ("Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 70)
               + ". Now name the fruits again:")


class DrillSetup(msgspec.Struct, frozen=True):
    url: str
    admin_token: str
    internal_token: str | None
    scenario_names: list[str] | None
    redis_url: str | None = None  # the cluster's Redis, for the audit log (None: none)
    namespace: str = "pdserve"


class DrillReport(msgspec.Struct):
    url: str
    layout: Layout
    skipped: list[str]
    options: DrillOptions
    rate_rps: float
    workload: str
    rows: list[DrillRow]
    passed: bool


async def discover_layout(cluster: TargetCluster) -> Layout:
    workers = await cluster.workers()
    if not workers:
        raise RuntimeError(f"{cluster.url}/admin/workers lists no worker")
    supervisor = cluster.supervisor_pid(workers)
    can_set_faults = False
    if cluster.internal_token is not None:
        try:
            await cluster.set_fault(workers[0], FaultRequest())  # all off: a no-op
            can_set_faults = True
        except (ControlError, TimeoutError):
            pass
    return Layout(
        roles=sorted(w.role for w in workers),
        num_gateways=len(processes.gateway_pids(supervisor)) if supervisor else 1,
        has_agent=bool(supervisor and processes.agent_pids(supervisor)),
        has_redis=bool(supervisor and processes.redis_pids(supervisor)),
        can_set_faults=can_set_faults, has_local_processes=supervisor is not None)


async def drill_main(setup: DrillSetup, args: argparse.Namespace) -> int:
    options = DrillOptions(
        before_s=args.before_s, after_s=args.after_s, fault_s=args.fault_s,
        recovery_timeout_s=args.recovery_timeout_s, idle_timeout_s=args.idle_timeout_s,
        check_tokens=args.check_tokens, request_timeout_s=args.request_timeout_s,
        faults=FaultSettings(args.slow_step_ms, args.stall_layer_ms, args.net_delay_ms,
                             args.net_loss, round(args.fault_s * 1000)))
    cluster = TargetCluster(setup.url, setup.admin_token, setup.internal_token)
    audit = None if setup.redis_url is None else \
        AgentState(RedisState(connect(setup.redis_url), setup.namespace))
    publisher = DrillPublisher(DrillMetrics(), audit)
    await cluster.open()
    passed = True
    try:
        await publisher.start(args.metrics_port)
        if publisher.url is not None:
            say(f"metrics on {publisher.url}")
        if audit is None:
            say("no Redis URL known: the rows do not go to the audit log (--redis-url)")
        layout = await discover_layout(cluster)
        scenarios, skipped = select(setup.scenario_names, layout)
        say(f"cluster {setup.url}: workers {', '.join(layout.roles)}; "
            f"{layout.num_gateways} gateway(s); agent {'yes' if layout.has_agent else 'no'}; "
            f"faults {'on' if layout.can_set_faults else 'off'}")
        for line in skipped:
            say(f"skipped {line}")
        model = await fetch_model_id(setup.url, 10.0, None)
        workload = load_workload(args.workload)
        corpus = Corpus.load()

        def make_load(index: int) -> SteadyLoad:
            seed = args.seed + index
            return SteadyLoad(setup.url, model, RequestPlanner(workload, corpus, seed),
                              args.rate, args.request_timeout_s, seed)

        drill = Drill(cluster, layout, model, make_load, options, (*PROMPTS, LONG_PROMPT),
                      resolve_slos(workload, []))

        def write(rows: list[DrillRow]) -> None:
            if args.output:
                report = DrillReport(setup.url, layout, skipped, options, args.rate,
                                     workload.name, rows, all(not r.problems for r in rows))
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.write_bytes(msgspec.json.format(msgspec.json.encode(report),
                                                            indent=2))

        num_rounds = args.rounds or (1 if args.schedule is None else None)
        round_number = 0
        while True:
            rows = await drill.run(scenarios, write)
            round_number += 1
            await publisher.publish(rows)
            print(markdown_table(rows), flush=True)
            if args.output:  # by `write`, after the round's last row
                say(f"wrote {args.output}")
            passed = passed and all(not r.problems for r in rows)
            if num_rounds is not None and round_number >= num_rounds:
                break
            say(f"round {round_number} done; the next in {args.schedule or 0:g} s")
            await asyncio.sleep(args.schedule or 0)
    except (RuntimeError, ValueError) as exc:
        print(f"pdserve drill: {exc}", file=sys.stderr)
        return 2
    finally:
        await cluster.aclose()
        await publisher.stop()
    return 0 if passed else 1
