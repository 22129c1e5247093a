#!/usr/bin/env bash
# bench/fetch_device_wheels.sh: download, on a machine with network, the wheels bench/device_check.sh
# installs on a GPU machine without network (python 3.12, manylinux x86_64) into .whl/ (gitignored;
# copy it beside the checkout there).
#
# Why each one, for a GPU image with CUDA torch 2.11, transformers 5.17 and hub 1.33 but no gRPC:
#   grpcio 1.85.3            the generated omni/v1/*_grpc.py require grpcio >= 1.85.1 (its version is
#                            not recorded for the image)
#   grpcio-health-checking,  not on the image; every stage and the launcher import them
#   grpcio-reflection 1.85.1
#   grpcio-status 1.85.1,    not on the image; the stages' rich error details (google.rpc) import them
#   googleapis-common-protos 1.76.0
#   opentelemetry-* 1.45.2   not on the image; every process imports the tracing setup
#   av 18.1.0 (36 MB)        not on the image; the thinker maps PyAV's FFmpeg at start (video input)
#   (0.66b2 for the semantic conventions and the OTLP common package)
#   protobuf 7.36.2          the generated *_pb2.py (protoc 7.35.1) need a 7.x runtime >= 7.35.1
#   transformers 5.19.0      the image has 5.17.0; the engines are written and tested against 5.19
#                            (row-wise experts hook, mask early exit, grouped_mm experts, no_init_weights).
#                            Its requirements are 5.17's but for huggingface-hub (>=1.31,<3): the image's
#                            hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0, regex, typer satisfy them.
# Not carried: torch (the image's 2.11.0+cu130), huggingface_hub (2.x would need httpx2, which the
# image lacks), numpy/pillow/matplotlib/prometheus-client (on the image), soundfile (only for audio
# prompts; needs cffi, which the image lacks; the benchmark sends text).
#
# Usage: bash bench/fetch_device_wheels.sh   (prints the total size)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=(
  grpcio==1.85.3
  grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1
  grpcio-status==1.85.1
  googleapis-common-protos==1.76.0
  protobuf==7.36.2
  transformers==5.19.0
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  av==18.1.0
)
mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$wheel"
done
# One version of each: an older download of the same name would stop the install there.
ls -1 .whl/*.whl | sed -E 's#.*/([^-]+)-.*#\1#' | sort | uniq -d | while read -r dup; do
  echo "two versions of $dup in .whl: remove the stale one" >&2; exit 1
done
ls -la .whl
du -ch .whl/*.whl | tail -1
