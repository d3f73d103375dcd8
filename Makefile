# Quick start:  make demo   |   make test
#
# The virtual environment lives outside the clone (it holds a ~5 GB CUDA build of torch), so
# fresh clones and CI reuse it; it is refreshed when requirements/test.txt changes.

PYTHON     ?= python3
TORCH_SPEC ?= torch==2.14.1
VENV       ?= $(HOME)/.cache/hashattention/venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
export MAX_JOBS ?= $(shell nproc)
export TORCH_CUDA_ARCH_LIST ?= 9.0
PYTEST_ARGS ?=

.PHONY: all venv build test demo bench-cpu clean

all: test

venv: $(VENV)/.ready

$(VENV)/.ready: requirements/test.txt requirements/no-deps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -r requirements/test.txt
	$(PIP) install --quiet --no-deps -r requirements/no-deps.txt
	touch $@

# Incremental: ninja recompiles only what changed (build/ is kept in the clone).
build: venv
	$(PIP) install --quiet --no-build-isolation --no-deps -e .

test: build
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: build
	$(PY) examples/demo.py

bench-cpu: build
	$(PY) -m benchmarks.ops_cpu

clean:
	rm -rf build hashattention/_C*.so *.egg-info
