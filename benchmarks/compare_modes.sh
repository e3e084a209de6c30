#!/usr/bin/env bash
# Goodput of several `pdserve up` configurations on the same machine, model and workload,
# side by side in one run, each under both admission settings: the colocated baselines a
# user would try (1, 2 and, on a GPU, 4 workers, under CUDA MPS where several share it),
# static disaggregation (1 prefill + 1 decode worker; 1 + 3 on a GPU), adaptive (2 and,
# on a GPU, 4 workers of role `both`, the router predicting each request's plan) and, on a
# GPU, one worker with a prefill lane (prompts on their own SMs beside the decode steps). The ratio
# it reports divides by the best colocated goodput over every N and both admissions.
#
# The clusters run one after the other, never at once: they would otherwise share the
# CPU cores / GPU and each would measure the other's load. Each gets the same `pdserve bench
# goodput` search (same seed, so the same requests at every rate).
#
# Usage: benchmarks/compare_modes.sh [OUT_DIR]        (default OUT_DIR: bench-results/<time>)
# Settings (environment):
#   WORKLOAD=mixed  DURATION=60  START_RATE=0.5  MAX_RUNS=12  SEED=0  API=chat
#   RATE_TOLERANCE=0.05  bisect until a passing and a failing rate are this close (relative)
#   ADMISSIONS="adaptive static"  each mode under each (PDSERVE_ADMISSION)
#   MODES      ";"-separated NAME=UP_ARGS pairs, run in order (default below: on a GPU,
#              when UP_ARGS says --device cuda, the GPU list); UP_ARGS may start with
#              VAR=value words, that mode's environment (e.g. "PDSERVE_STEP_BUDGET=tpot
#              --colocated --workers 1")
#   UP_ARGS    extra `pdserve up` options for every mode (e.g. "--model /m --device cuda")
#   BENCH_ARGS extra `pdserve bench goodput` options (e.g. --slo)
#   READY_TIMEOUT=600                    seconds to wait for a cluster's /ready
#   WARMUP=20                            seconds of discarded warm-up load at START_RATE
#                                        (long enough for kernels to compile and for the
#                                        gateway's capacity governor to settle after them)
# On a CPU, give `pdserve up` tiers it can meet (UP_ARGS="--tiers benchmarks/tiers-cpu.toml")
# and PDSERVE_ADMISSION=static: see docs/performance.md, "Measure your own deployment".
# Output: OUT_DIR/<mode>@<admission>/{goodput.json,curve.txt,plans.txt,workers.json,up.log,
#         plots/} and OUT_DIR/summary.json: every goodput with its bracket (the highest
#         passing and the lowest failing rate), the best colocated one over every N and
#         admission, every other mode over it, and each mode's default (adaptive) admission
#         over its static one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT_DIR="${1:-$ROOT/bench-results/$(date -u +%Y%m%dT%H%M%SZ)}"
WORKLOAD="${WORKLOAD:-mixed}"
DURATION="${DURATION:-60}"
START_RATE="${START_RATE:-0.5}"
MAX_RUNS="${MAX_RUNS:-12}"
RATE_TOLERANCE="${RATE_TOLERANCE:-0.05}"
ADMISSIONS="${ADMISSIONS:-adaptive static}"
SEED="${SEED:-0}"
API="${API:-chat}"
READY_TIMEOUT="${READY_TIMEOUT:-600}"
WARMUP="${WARMUP:-20}"
UP_ARGS="${UP_ARGS:-}"
if [[ "$UP_ARGS" == *"--device cuda"* ]]; then
    DEFAULT_MODES="colocated-1=--colocated --workers 1;colocated-2=--colocated --workers 2"
    DEFAULT_MODES+=";colocated-4=--colocated --workers 4;static=--prefill 1 --decode 1"
    DEFAULT_MODES+=";static-1p3d=--prefill 1 --decode 3;adaptive=--workers 2 --roles both"
    DEFAULT_MODES+=";adaptive-4=--workers 4 --roles both"
    DEFAULT_MODES+=";lane=PDSERVE_PREFILL_LANE=auto --colocated --workers 1"
else
    DEFAULT_MODES="colocated-1=--colocated --workers 1;colocated-2=--colocated --workers 2"
    DEFAULT_MODES+=";static=--prefill 1 --decode 1;adaptive=--workers 2 --roles both"
fi
MODES="${MODES:-$DEFAULT_MODES}"
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

run_mode() {  # $1: mode name, $2: extra `pdserve up` options, $3: admission
    local mode="$1@$3" up_args="" admission="$3" port url dir word
    local -a mode_env=()
    # Leading VAR=value words are the mode's environment (e.g. PDSERVE_STEP_BUDGET=tpot).
    for word in $2; do
        if [[ -z "$up_args" && "$word" =~ ^[A-Z_][A-Z0-9_]*= ]]; then
            mode_env+=("$word")
        else
            up_args+="${up_args:+ }$word"
        fi
    done
    dir="$OUT_DIR/$mode"
    mkdir -p "$dir"
    port="$(free_port)"
    url="http://127.0.0.1:$port"
    echo ">> $mode: PDSERVE_ADMISSION=$admission ${mode_env[*]} pdserve up --port $port" \
        "$up_args" >&2
    # shellcheck disable=SC2086  # word splitting of the option strings is intended
    env PDSERVE_ADMISSION="$admission" "${mode_env[@]}" "$PY" -m launcher.cli up --port "$port" $up_args \
        >"$dir/up.log" 2>&1 &
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
        --max-runs "$MAX_RUNS" --rate-tolerance "$RATE_TOLERANCE" --ignore-eos \
        --output "$dir/goodput.json" \
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
    for admission in $ADMISSIONS; do
        NAMES+=("$name@$admission")
        run_mode "$name" "$args $UP_ARGS" "$admission"
    done
done

"$PY" - "$OUT_DIR" "${NAMES[@]}" <<'EOF'
import json, sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
modes = {m: json.loads((out / m / "goodput.json").read_text()) for m in names}
goodput = {m: r["goodput_rps"] for m, r in modes.items()}


def bracket(report):
    """[the highest passing rate below the lowest failing one, that failing rate]."""
    points = [(p["rate_rps"], p["passed"]) for p in report["points"]]
    fails = [rate for rate, passed in points if not passed]
    hi = min(fails) if fails else None
    passes = [rate for rate, passed in points if passed and (hi is None or rate < hi)]
    return [max(passes) if passes else None, hi]


colocated = {m: g for m, g in goodput.items() if m.startswith("colocated") and g}
best = max(colocated, key=colocated.get) if colocated else None
over_best = {m: (g / colocated[best] if best and g else None)
             for m, g in goodput.items() if not m.startswith("colocated")}
default_over_static = {}
for m, g in goodput.items():
    name, _, admission = m.rpartition("@")
    static = goodput.get(f"{name}@static")
    if admission == "adaptive" and static:
        default_over_static[name] = (g or 0.0) / static
summary = {"schema_version": 3, "kind": "compare_modes", "goodput_rps": goodput,
           "bracket_rps": {m: bracket(r) for m, r in modes.items()},
           "bound": {m: r["bound"] for m, r in modes.items()},
           "attainment_target": next(iter(modes.values()))["attainment_target"],
           "best_colocated": best, "over_best_colocated": over_best,
           "default_admission_over_static": default_over_static}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
