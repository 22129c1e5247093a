#!/usr/bin/env bash
# bench/device_check.sh: the full-size GPU profile and benchmark in one prepared run.
#
# On any machine with one NVIDIA GPU, CUDA torch installed and no network, in the repository root:
#   1. installs the wheels copied beside the checkout (.whl/*.whl, see below) into /tmp/site and
#      writes env.txt (versions, nvidia-smi, whether nvidia-cuda-mps-control is there);
#   2. only with GPU_TESTS=1: capture and replay on the tiny checkpoint (tests/gpu, < 1 min, pytest.txt);
#   3. writes the full-size folder without weights (omni-tiny-checkpoint --full-size --no-weights:
#      the real Qwen3-Omni-30B-A3B layout, the tiny tokenizer);
#   4. profile (bench/probes/gpu_steps.py, in process, one stage at a time, bfloat16, graphs on):
#      prefill of 25/400/1,600 tokens, decode steps at batch 1/16/64 (wall, forward, GPU time per
#      graph replay, syncs), a torch.profiler table at 16: gpu_steps.json and gpu_steps_*_profile.txt;
#   5. benchmark (bench/device_bench.py): code2wav, talker, thinker and the router as processes on
#      the one GPU, random weights, bfloat16, graphs on, closed loop at 1, 32 and 64 requests in
#      flight (3c requests a level), without MPS and then with it where nvidia-cuda-mps-control
#      exists (a fresh stack each): device_bench.json (per-request timelines, per-level stage
#      metrics and GPU samples), device_bench.md, device_bench.png, stack.log;
#   6. prints the tables. Every phase has a timeout and writes its JSON as it goes; the whole script
#      ends within TOTAL_S (default 420 s: 7 minutes; the profile takes at most PROFILE_S, 150 s).
#
# What must be copied beside the checkout first (both gitignored, both made on a machine with
# network): `.whl/` (bench/fetch_device_wheels.sh: the Python packages the GPU machine may lack)
# and `omni/` (the protobuf code from `make proto`; grpcio-tools need not be on the GPU machine).
#   bash bench/device_check.sh                      # results in bench/results/device-check-<UTC time>
#   RESULTS=/some/dir bash bench/device_check.sh    # results elsewhere (a lent device machine: $OUT/...)
# Knobs: GRAPHS (on), SHARING (none,mps where MPS exists, else none), LEVELS (1,32,64), RATES
# (open-loop requests/s, none), LONG=1 (300-frame answers), THINKER_TOKENS/TALKER_TOKENS (16/40),
# SKIP_PROFILE=1, GPU_TESTS=1, TOTAL_S, PROFILE_S.
#
# CPU dry run of the same flow (tiny layout, random weights, float32, graphs off, 2-4 minutes on 2
# cores; results in out/device_check-dry-run, never under bench/results unless RESULTS says so):
#   DEVICE=cpu SMALL=1 bash bench/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
TOTAL_S=${TOTAL_S:-420}
PROFILE_S=${PROFILE_S:-150}
if [ "$DEVICE" = cpu ] || [ "$SMALL" = 1 ]; then
  RESULTS=${RESULTS:-out/device_check-dry-run}
  FOLDER=${FOLDER:-/tmp/omni-tiny-layout-dry-run}
else
  RESULTS=${RESULTS:-bench/results/device-check-$(date -u +%Y%m%d-%H%M)}
  FOLDER=${FOLDER:-/tmp/omni-full-size}
fi
if [ -z "${PY:-}" ]; then
  if [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PIDS="$RESULTS/stage.pids"
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then MPS_HERE=1; else MPS_HERE=0; fi
SHARING=${SHARING:-$( [ "$MPS_HERE" = 1 ] && echo none,mps || echo none )}

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
  date -u; uname -a; git log -1 --format='commit %H %s' 2>/dev/null; nvidia-smi 2>&1 | head -20
  nvidia-smi -q 2>/dev/null | grep -i -m1 "compute mode"
  echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo 'not found (the benchmark runs without MPS)')"
  timeout 60 "$PY" - <<'EOF'
import importlib
for name in ("torch", "transformers", "tokenizers", "safetensors", "grpc", "google.protobuf", "numpy", "matplotlib",
             "prometheus_client", "pynvml"):
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
tail -16 "$RESULTS/env.txt"
grep -q "imports ok" "$RESULTS/env.txt" || { say "environment check failed (see env.txt)"; exit 2; }

# 2. Capture and replay on the tiny checkpoint (only when asked: GPU_TESTS=1).
if [ "$DEVICE" != cpu ] && [ "${GPU_TESTS:-0}" = 1 ]; then
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

# 4. The profile, one stage at a time in this process (its JSON is written after every phase).
if [ "$SMALL" = 1 ]; then
  PROFILE=(--device "$DEVICE" --dtype float32 --batches 1,2 --steps 3 --warmup 1 --profile-batch 2 --profile-steps 2
           --max-model-len 128 --buckets 1,2,4,8 --threads 2)
else
  PROFILE=(--device "$DEVICE" --dtype bfloat16 --batches 1,16,64 --steps 20 --warmup 3 --profile-batch 16
           --profile-steps 5 --max-model-len 256 --buckets 1,2,4,8,16,32,64)
fi
P_BUDGET=$(( $(left) - 120 < PROFILE_S ? $(left) - 120 : PROFILE_S ))  # the benchmark keeps 120 s at least
if [ "${SKIP_PROFILE:-0}" != 1 ] && [ "$P_BUDGET" -lt 30 ]; then
  say "profile skipped: ${P_BUDGET} s left for it"
elif [ "${SKIP_PROFILE:-0}" != 1 ]; then
  say "profile: ${PROFILE[*]} (at most ${P_BUDGET} s)"
  timeout -k 10 "$P_BUDGET" "$PY" -m bench.probes.gpu_steps --checkpoint "$FOLDER" --out "$RESULTS" "${PROFILE[@]}" \
    >"$RESULTS/gpu_steps.log" 2>&1
  say "profile exit code $? (gpu_steps.json, gpu_steps.log)"
  grep -E "built in|prefill|decode|profile host|Error" "$RESULTS/gpu_steps.log" | cut -c1-220
fi

# 5. The benchmark, inside what is left of TOTAL_S (30 s kept for stopping and printing).
if [ "$SMALL" = 1 ]; then
  ARGS=(--label "Tiny layout (CPU dry run)" --device "$DEVICE" --dtype float32 --graphs "${GRAPHS:-auto}"
        --gpu-sharing "$SHARING" --levels "${LEVELS:-1,4}" --rates "${RATES:-2}" --open-requests 4
        --thinker-tokens 6 --talker-tokens 12 --max-batch 8 --max-model-len 128 --buckets 1,2,4,8)
else
  ARGS=(--device "$DEVICE" --dtype bfloat16 --graphs "${GRAPHS:-on}" --gpu-sharing "$SHARING"
        --levels "${LEVELS:-1,32,64}" --rates "${RATES:-}" --max-batch 64 --buckets 1,2,4,8,16,32,64)
  if [ "${LONG:-0}" = 1 ]; then
    ARGS+=(--long-answer --max-model-len 512)
  else
    ARGS+=(--thinker-tokens "${THINKER_TOKENS:-16}" --talker-tokens "${TALKER_TOKENS:-40}" --max-model-len 256)
  fi
fi
BUDGET=$(( $(left) - 30 ))
say "benchmark: ${ARGS[*]} (deadline ${BUDGET} s); stage logs in $RESULTS/stack.log"
timeout -k 15 "$(( BUDGET + 20 ))" "$PY" -m bench.device_bench --checkpoint "$FOLDER" --out "$RESULTS" \
  --deadline-s "$BUDGET" --pids-file "$PIDS" "${ARGS[@]}" 2>"$RESULTS/stack.log"
RC=$?
say "benchmark exit code $RC"

# 6. What the stages said about graphs, MPS and errors, then the files.
grep -h -E "CUDA graph|gpu-sharing|MPS:" "$RESULTS/stack.log" | sed 's/^/  /' | tail -20
grep -h -E "Traceback|Error|error:" "$RESULTS/stack.log" | sort | uniq -c | sort -rn | head -10
ls -la "$RESULTS"
say "done in $(( $(date +%s) - START )) s"
exit $RC
