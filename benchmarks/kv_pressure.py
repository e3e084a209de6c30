"""A full KV cache, side by side: reservations answered at once (--kv-wait-s 0, the old
behaviour) against reservations that wait for free blocks (the default), on a `pdserve up`
cluster (1 prefill + 1 decode worker, default model, CPU) with a 256 MiB KV cache per
worker (the CPU default before it was sized from memory), one after the other with the
same seeded requests.

Workload: `--num-requests` completions of `--input-len` prompt tokens and `--output-len`
generated tokens (EOS ignored), Poisson arrivals at `--rate`, tier `--tier`; the goodput
SLO counted by the bench client is TTFT 2 s / TPOT 300 ms. A 256 MiB pool holds about a
dozen such requests, so at any rate above what it drains some reservations find it full.

    python -m benchmarks.kv_pressure [--rate 1] [--num-requests 40] [--waits 0,60]

Prints one row per setting: requests ok and failed (by error), throughput, TTFT p50,
and the decode worker's kv-wait counters.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from drill.up_cluster import UpCluster

WORKLOAD = """
name = "kv-pressure"
[slo.{tier}]
ttft_ms = 2000
tpot_ms = 300
[[classes]]
name = "fixed"
tier = "{tier}"
input_len = {input_len}
output_len = {output_len}
"""


def _kv_waits(cluster: UpCluster) -> dict[str, float]:
    counts: dict[str, float] = {}
    for worker in cluster.workers():
        with urllib.request.urlopen(worker["control_url"] + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            if line.startswith("pdserve_kv_waits_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                counts[outcome] = counts.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def run_one(wait_s: float, args: argparse.Namespace, workdir: Path) -> str:
    workload = workdir / "workload.toml"
    workload.write_text(WORKLOAD.format(input_len=args.input_len, output_len=args.output_len,
                                        tier=args.tier))
    report_path = workdir / f"run-wait{wait_s:g}.json"
    with UpCluster(args.up_args, workdir / f"up-wait{wait_s:g}.log",
                   env={"PDSERVE_KV_WAIT_S": str(wait_s)}) as cluster:
        cluster.wait_ready()
        command = [sys.executable, "-m", "launcher.cli", "bench", "run", "--url", cluster.url,
                   "--api", "completions", "--workload", str(workload), "--ignore-eos",
                   "--rate", str(args.rate), "--num-requests", str(args.num_requests),
                   "--duration", "3600", "--request-timeout", str(args.request_timeout),
                   "--seed", "1", "--output", str(report_path), "--no-progress"]
        print(f">> kv-wait {wait_s:g} s: {' '.join(command[1:])}", file=sys.stderr)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        waits = _kv_waits(cluster)
    overall = json.loads(report_path.read_text())["overall"]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(overall["errors_by_type"].items())) or "-"
    waited = ", ".join(f"{k} {v:g}" for k, v in sorted(waits.items())) or "-"
    return (f"| {wait_s:g} | {overall['num_completed']} | {overall['num_errors']} ({errors}) | "
            f"{overall['request_throughput_rps']:.2f} | {overall['ttft_ms']['p50']:.0f} | "
            f"{waited} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.kv_pressure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (default 1)")
    parser.add_argument("--num-requests", type=int, default=40, help="(default 40)")
    parser.add_argument("--input-len", type=int, default=512, help="(default 512)")
    parser.add_argument("--output-len", type=int, default=64, help="(default 64)")
    parser.add_argument("--tier", default="standard",
                        help="the pdserve tier the requests ask for (x-pdserve-tier); batch "
                             "(TTFT target 60 s) keeps admission from shedding them, so that "
                             "only the KV cache limits (default standard)")
    parser.add_argument("--waits", default="0,60",
                        help="--kv-wait-s settings to compare, comma-separated (default 0,60)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take (default 600)")
    parser.add_argument("--up-args", default="--threads-per-worker 1 --kv-cache-mb 256",
                        help="arguments for `pdserve up` (default: %(default)r)")
    args = parser.parse_args(argv)
    try:
        waits = [float(w) for w in args.waits.split(",")]
    except ValueError:
        parser.error(f"--waits: expected numbers separated by commas, got {args.waits!r}")
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-kv-pressure-"))
    rows = [run_one(wait_s, args, workdir) for wait_s in waits]
    print(f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
          f"tier {args.tier}, rate {args.rate:g}/s, `pdserve up {args.up_args}` (results in {workdir})")
    print("| --kv-wait-s | ok | failed | req/s | TTFT p50 ms | kv waits |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
