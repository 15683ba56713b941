PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp

.PHONY: setup test chat bench clean

setup: $(STAMP)

# torch first, pinned, so no other requirement can pull a (multi-GB) CUDA build
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

chat: setup
	$(BIN)/pagedserve chat

bench: setup
	$(BIN)/python -m pytest bench -q -p no:cacheprovider

clean:
	rm -rf $(VENV)

# the Triton kernels on a GPU, a compiled + CUDA-graphed model step against eager, decode throughput
.PHONY: gpu-check
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py
