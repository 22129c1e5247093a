# omni-serve: every target installs what it needs through `setup` (idempotent, quick when done).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= models/tiny-qwen3-omni
PORT ?= 50051
PROTO_SRC := $(wildcard protos/omni/v1/*.proto)
PROTO_OUT := omni/v1/omni_pb2.py
STAMP := $(VENV)/.installed

.PHONY: setup proto checkpoint run demo test test-all bench clean

setup: $(STAMP) $(PROTO_OUT)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)
	touch omni/__init__.py omni/v1/__init__.py

$(PROTO_OUT): $(PROTO_SRC) | $(STAMP)
	$(MAKE) proto

checkpoint: $(CHECKPOINT)/config.json

$(CHECKPOINT)/config.json: | setup
	$(VENV)/bin/omni-tiny-checkpoint --out $(CHECKPOINT)

# Serve the whole stack (router + thinker + talker + code2wav) on the tiny checkpoint.
run: setup checkpoint
	$(VENV)/bin/omni-serve up --checkpoint $(CHECKPOINT) --port $(PORT)

# Start the stack, turn one prompt into out/demo.wav, stop the stack.
demo: setup checkpoint
	$(VENV)/bin/omni-serve demo --checkpoint $(CHECKPOINT) --out out/demo.wav

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ""

bench: setup checkpoint
	$(VENV)/bin/omni-bench --checkpoint $(CHECKPOINT) --out out

clean:
	rm -rf $(VENV) omni models out
