#!/usr/bin/env bash
# Goodput of several `pdserve up` configurations on the same machine, model and workload,
# side by side in one run: the colocated ones (1, 2, 4 workers; with and without CUDA MPS),
# static disaggregation (1 prefill + 1 decode worker) and adaptive (2 workers of role
# `both`, the router predicting each request's plan).
#
# The clusters run one after the other, never at once: they would otherwise share the
# CPU cores / GPU and each would measure the other's load. Each gets the same `pdserve bench
# goodput` search (same seed, so the same requests at every rate).
#
# Usage: benchmarks/compare_modes.sh [OUT_DIR]        (default OUT_DIR: bench-results/<time>)
# Settings (environment):
#   WORKLOAD=mixed  DURATION=60  START_RATE=0.5  MAX_RUNS=8  SEED=0  API=chat
#   MODES      ";"-separated NAME=UP_ARGS pairs, run in order (default below)
#   UP_ARGS    extra `pdserve up` options for every mode (e.g. "--model /m --device cuda")
#   BENCH_ARGS extra `pdserve bench goodput` options (e.g. --slo)
#   READY_TIMEOUT=600                    seconds to wait for a cluster's /ready
#   WARMUP=20                            seconds of discarded warm-up load at START_RATE
#                                        (long enough for kernels to compile and for the
#                                        gateway's capacity governor to settle after them)
# On a CPU, give `pdserve up` tiers it can meet (UP_ARGS="--tiers benchmarks/tiers-cpu.toml")
# and PDSERVE_ADMISSION=static: see docs/performance.md, "Measure your own deployment".
# Output: OUT_DIR/<mode>/{goodput.json,curve.txt,plans.txt,workers.json,up.log,plots/} and
#         OUT_DIR/summary.json (every goodput, the best colocated one, and adaptive and
#         static over it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT_DIR="${1:-$ROOT/bench-results/$(date -u +%Y%m%dT%H%M%SZ)}"
WORKLOAD="${WORKLOAD:-mixed}"
DURATION="${DURATION:-60}"
START_RATE="${START_RATE:-0.5}"
MAX_RUNS="${MAX_RUNS:-8}"
SEED="${SEED:-0}"
API="${API:-chat}"
READY_TIMEOUT="${READY_TIMEOUT:-600}"
WARMUP="${WARMUP:-20}"
DEFAULT_MODES="colocated-1=--colocated --workers 1;colocated-2=--colocated --workers 2 --no-mps"
DEFAULT_MODES+=";colocated-2-mps=--colocated --workers 2;static=--prefill 1 --decode 1"
DEFAULT_MODES+=";adaptive=--workers 2 --roles both"
MODES="${MODES:-$DEFAULT_MODES}"
UP_ARGS="${UP_ARGS:-}"
BENCH_ARGS="${BENCH_ARGS:-}"

mkdir -p "$OUT_DIR"
UP_PID=""

stop_cluster() {
    if [[ -n "$UP_PID" ]] && kill -0 "$UP_PID" 2>/dev/null; then
        kill -TERM "$UP_PID"
        for _ in $(seq 60); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$UP_PID" 2>/dev/null && kill -KILL "$UP_PID"
        wait "$UP_PID" 2>/dev/null || true
    fi
    UP_PID=""
}
trap stop_cluster EXIT INT TERM

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_ready() {  # $1: base URL; polls /ready (a decode worker registered) until READY_TIMEOUT
    local deadline=$((SECONDS + READY_TIMEOUT))
    until curl -fsS --max-time 5 "$1/ready" >/dev/null 2>&1; do
        if ! kill -0 "$UP_PID" 2>/dev/null; then
            echo "pdserve up exited before it was ready" >&2; return 1
        fi
        if (( SECONDS > deadline )); then
            echo "pdserve up not ready after ${READY_TIMEOUT}s" >&2; return 1
        fi
        sleep 2
    done
}

run_mode() {  # $1: mode name, $2: extra `pdserve up` options
    local mode="$1" up_args="$2" port url dir
    dir="$OUT_DIR/$mode"
    mkdir -p "$dir"
    port="$(free_port)"
    url="http://127.0.0.1:$port"
    echo ">> $mode: pdserve up --port $port $up_args" >&2
    # shellcheck disable=SC2086  # word splitting of the option strings is intended
    "$PY" -m launcher.cli up --port "$port" $up_args >"$dir/up.log" 2>&1 &
    UP_PID=$!
    wait_ready "$url"
    # Warm-up, discarded: the first requests compile kernels and fill caches; a search
    # whose first point pays for that would bracket the wrong rate.
    echo ">> $mode: warm-up" >&2
    "$PY" -m launcher.cli bench run --url "$url" --api "$API" --workload "$WORKLOAD" \
        --seed "$((SEED + 1))" --rate "$START_RATE" --duration "$WARMUP" --ignore-eos \
        --no-progress --output "$dir/warmup.json" >/dev/null
    echo ">> $mode: pdserve bench goodput ($WORKLOAD)" >&2
    # shellcheck disable=SC2086
    "$PY" -m launcher.cli bench goodput --url "$url" --api "$API" --workload "$WORKLOAD" \
        --seed "$SEED" --duration "$DURATION" --start-rate "$START_RATE" \
        --max-runs "$MAX_RUNS" --ignore-eos --output "$dir/goodput.json" \
        --plot "$dir/plots" $BENCH_ARGS | tee "$dir/curve.txt"
    # What the cluster did: the plans the router chose (by kind, how and tier) and each
    # worker's role, load and fitted step model as the search ended.
    curl -fsS --max-time 10 "$url/metrics" | grep '^pdserve_gateway_plans_total' \
        >"$dir/plans.txt" || true
    curl -fsS --max-time 10 "$url/admin/workers" >"$dir/workers.json" || true
    stop_cluster
}

NAMES=()
IFS=';' read -ra MODE_SPECS <<<"$MODES"
for spec in "${MODE_SPECS[@]}"; do
    name="${spec%%=*}"
    args="${spec#*=}"
    NAMES+=("$name")
    run_mode "$name" "$args $UP_ARGS"
done

"$PY" - "$OUT_DIR" "${NAMES[@]}" <<'EOF'
import json, sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
modes = {m: json.loads((out / m / "goodput.json").read_text()) for m in names}
goodput = {m: r["goodput_rps"] for m, r in modes.items()}
colocated = {m: g for m, g in goodput.items() if m.startswith("colocated") and g}
best = max(colocated, key=colocated.get) if colocated else None


def over_best(mode):
    if best is None or not goodput.get(mode):
        return None
    return goodput[mode] / colocated[best]


summary = {"schema_version": 2, "kind": "compare_modes", "goodput_rps": goodput,
           "bound": {m: r["bound"] for m, r in modes.items()},
           "attainment_target": next(iter(modes.values()))["attainment_target"],
           "best_colocated": best,
           "adaptive_over_best_colocated": over_best("adaptive"),
           "static_over_best_colocated": over_best("static")}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
