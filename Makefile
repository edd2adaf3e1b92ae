# minivllm: set-up and the two main commands.
#   make test   create .venv, install everything, run the whole suite with both backends
#   make demo   answer a chat prompt with the default model (SmolLM2-135M-Instruct)
#   make docs   build the book into docs/_build/html, strictly (warnings are errors),
#               executing every tutorial once
#   make docs-check  open the built book in headless Chromium (tests/test_docs_site.py)
# CI runs `make test docs docs-check` (.ci/run).
#
# TORCH is the torch requirement. The default is the CPU build this project is
# developed against; on a machine where pip would pick a CUDA build you do not
# want, point pip at CPU wheels (see the README).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-ref test-fast demo lint model gpu-check docs docs-check

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The C++ CPU kernels, compiled once into torch's extension cache (a minute or
# two); without a compiler this prints why and minivllm uses the ref kernels.
setup: $(VENV)/.installed
	$(PY) -m minivllm.fast.cpu_ops

model: setup
	$(VENV)/bin/minivllm download smollm2

test: setup model
	$(PY) -m pytest -q --backend=ref $(PYTEST_ARGS)
	$(PY) -m pytest -q --backend=fast $(PYTEST_ARGS)

test-ref: setup
	$(PY) -m pytest -q --backend=ref $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q --backend=fast $(PYTEST_ARGS)

demo: setup model
	$(VENV)/bin/minivllm generate --chat "What is the capital of France? Answer in one sentence."

$(VENV)/.docs-installed: pyproject.toml | $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# Built from scratch every time, so a stale page never hides a warning; the tutorials'
# execution times land in docs/_build/html/sg_execution_times.html.
docs: setup model $(VENV)/.docs-installed
	rm -rf docs/_build docs/tutorials docs/sg_execution_times.rst
	@start=$$(date +%s); \
	$(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html || exit 1; \
	echo "make docs: built docs/_build/html in $$(( $$(date +%s) - start )) s"

# Debian's chromium (apt-get needs root, as in CI); the test skips with a reason without it.
docs-check: $(VENV)/.docs-installed
	command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }
	$(PY) -m pytest -q -p no:cacheprovider tests/test_docs_site.py

lint: setup
	$(VENV)/bin/ruff check minivllm tests tutorials benchmarks

gpu-check:
	bash benchmarks/gpu_check.sh
