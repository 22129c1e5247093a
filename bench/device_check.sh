#!/usr/bin/env bash
# bench/device_check.sh: the full-size GPU benchmark in one prepared run.
#
# On any machine with one NVIDIA GPU, CUDA torch installed and no network, in the repository root:
#   1. installs the wheels copied beside the checkout (.whl/*.whl, see below) into /tmp/site;
#   2. checks capture and replay on the tiny checkpoint (tests/gpu/test_graphs_on_cuda.py, < 1 min;
#      the result goes to pytest.txt; a failure is reported, the benchmark still runs: a stage whose
#      capture fails serves eagerly and says so in stack.log);
#   3. writes the full-size folder without weights (omni-tiny-checkpoint --full-size --no-weights:
#      the real Qwen3-Omni-30B-A3B layout, the tiny tokenizer);
#   4. runs bench/device_bench.py: code2wav, talker, thinker and the router as processes, all on the
#      one GPU, random weights made on the device, bfloat16; concurrency 1, 16 and 64; CUDA graphs
#      on, then off (a fresh stack each);
#   5. leaves device_bench.json, device_bench.png, device_bench.md, stack.log, pytest.txt and
#      env.txt in $RESULTS (default out/device_check) and prints the table.
# Every phase has a timeout; the whole script ends within TOTAL_S (default 470 s < 8 minutes).
#
# What must be copied beside the checkout first (both gitignored, both made on a machine with
# network): `.whl/` (bench/fetch_device_wheels.sh: the Python packages the GPU machine may lack)
# and `omni/` (the protobuf code from `make proto`; grpcio-tools need not be on the GPU machine).
#   bash bench/device_check.sh                      # results in out/device_check
#   RESULTS=/some/dir bash bench/device_check.sh    # results elsewhere
#
# CPU dry run of the same flow (tiny layout, random weights, graphs auto/off, 2-3 minutes):
#   DEVICE=cpu SMALL=1 RESULTS=out/device_check bash bench/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
TOTAL_S=${TOTAL_S:-470}
RESULTS=${RESULTS:-out/device_check}
if [ -z "${PY:-}" ]; then
  if [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
FOLDER=${FOLDER:-/tmp/omni-full-size}
PIDS="$RESULTS/stage.pids"

say() { echo "[device_check $(( $(date +%s) - START )) s] $*"; }
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

cleanup() {
  # Stage processes run in their own sessions (the launcher's start_new_session): stop the ones
  # this run started, by id, if the benchmark did not get to stop them itself.
  if [ -s "$PIDS" ]; then
    for pid in $(cat "$PIDS"); do kill -TERM "$pid" 2>/dev/null || true; done
    sleep 2
    for pid in $(cat "$PIDS"); do kill -KILL "$pid" 2>/dev/null || true; done
    rm -f "$PIDS"
  fi
}
trap cleanup EXIT

# 1. Wheels and environment.
if [ "$DEVICE" != cpu ] && compgen -G ".whl/*.whl" >/dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { say "wheel install failed"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
elif [ "$DEVICE" != cpu ]; then
  say "no .whl/*.whl: copy the wheels from bench/fetch_device_wheels.sh beside the checkout (using what is installed)"
fi
if [ ! -f omni/v1/omni_pb2.py ]; then
  say "omni/v1/omni_pb2.py missing: run 'make proto' where grpcio-tools is installed and copy omni/ here"; exit 2
fi
{
  date -u; uname -a; nvidia-smi 2>&1 | head -20
  timeout 60 "$PY" - <<'EOF'
import importlib
for name in ("torch", "transformers", "tokenizers", "safetensors", "grpc", "google.protobuf", "numpy", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as exc:
        print(name, "MISSING", exc)
import torch
print("cuda available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
from grpc_health.v1 import health_pb2  # noqa: F401  (grpcio-health-checking, a carried wheel)
import omni.v1.omni_pb2_grpc  # noqa: F401  (generated code against this grpcio / protobuf)
print("imports ok")
EOF
} >"$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt" | tail -12
grep -q "imports ok" "$RESULTS/env.txt" || { say "environment check failed (see env.txt)"; exit 2; }

# 2. Capture and replay on the tiny checkpoint (skipped on CPU).
if [ "$DEVICE" != cpu ] && [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  say "graph capture tests on the tiny checkpoint"
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_graphs_on_cuda.py tests/gpu/test_cuda_graphs.py \
    >"$RESULTS/pytest.txt" 2>&1
  say "graph capture tests: exit $? ($(tail -1 "$RESULTS/pytest.txt"))"
fi

# 3. The folder: config + tokenizer + processor files, no weights.
rm -rf "$FOLDER"
if [ "$SMALL" = 1 ]; then
  say "writing the tiny layout without weights to $FOLDER"
  timeout 120 "$PY" -m services.tools.tiny_checkpoint --no-weights --out "$FOLDER" || exit 2
else
  say "writing the full-size layout without weights to $FOLDER"
  timeout 120 "$PY" -m services.tools.tiny_checkpoint --full-size --no-weights --out "$FOLDER" || exit 2
fi

# 4. The benchmark, inside what is left of TOTAL_S (30 s kept for stopping and printing).
if [ "$SMALL" = 1 ]; then
  ARGS=(--label "Tiny layout (CPU dry run)" --device "$DEVICE" --dtype float32 --graphs "${GRAPHS:-auto,off}" --levels "${LEVELS:-1,4}"
        --min-requests 2 --thinker-tokens 6 --talker-tokens 12 --max-batch 8 --max-model-len 128 --buckets 1,2,4,8)
else
  ARGS=(--device "$DEVICE" --dtype bfloat16 --graphs "${GRAPHS:-on,off}" --levels "${LEVELS:-1,16,64}"
        --min-requests 4 --thinker-tokens "${THINKER_TOKENS:-16}" --talker-tokens "${TALKER_TOKENS:-40}"
        --max-batch 64 --max-model-len 256 --buckets 1,2,4,8,16,32,64)
fi
BUDGET=$(( $(left) - 30 ))
say "benchmark: ${ARGS[*]} (deadline ${BUDGET} s); stage logs in $RESULTS/stack.log"
timeout -k 15 "$(( BUDGET + 20 ))" "$PY" -m bench.device_bench --checkpoint "$FOLDER" --out "$RESULTS" \
  --deadline-s "$BUDGET" --pids-file "$PIDS" "${ARGS[@]}" 2>"$RESULTS/stack.log"
RC=$?
say "benchmark exit code $RC"

# 5. What the stages said about graphs and errors, then the files.
grep -h "CUDA graph" "$RESULTS/stack.log" | sed 's/^/  /' | tail -20
grep -h -E "Traceback|Error|error:" "$RESULTS/stack.log" | sort | uniq -c | sort -rn | head -10
ls -la "$RESULTS"
say "done in $(( $(date +%s) - START )) s"
exit $RC
