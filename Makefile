# Two entry points that set up everything they need on a fresh machine:
#   make demo   - run the demo on the default model (SmolLM2-135M-Instruct)
#   make test   - run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo test check test-fitted test-real fuzz lint bench clean

# Test files run whole on parallel workers (pytest-xdist): most tests wait on a model thread,
# a subprocess or a socket, so three workers overlap them on two cores.
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadfile
# Tiny test models (the family matrix's above all) are built once into this checkout's
# .cache/ and reused by every later run (CI's four runs, an edit loop).
export MLX_PROVIDERS_TEST_CACHE ?= $(CURDIR)/.cache/test-models

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,langchain,llama-index,server,vision]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -ra $(XDIST) --durations=10 -m 'not real and not fitted'

# CI runs these too: the family matrix (every family's real tokenizer and template, its tiny
# model), family models fitted to write their own calls and reasoning, every family through
# ChatMLXBatch, MLXBatchLLM and the server, each family's own syntax and constrained replies
# (~11 min on two cores), the vision zoo's other checkpoints of each family, and the image
# proofs on the served vision families make test leaves to the zoo, and the sharded crossings'
# serial-lane and kv_bits launches (two ranks each).
test-fitted: $(STAMP)
	$(BIN)/python -m pytest -ra $(XDIST) -m fitted tests/families tests/engine tests/distributed

# The edit loop: lint, then everything but the slow and multi-process cases (a few minutes).
check: $(STAMP)
	$(BIN)/ruff check engine mlx_providers tests testkit bench examples
	$(BIN)/python -m pytest -ra $(XDIST) -m 'not slow and not distributed and not real and not fitted'

# The real default model: LangChain's standard suite, agents, and the engine's longer decodes.
test-real: $(STAMP)
	$(BIN)/python -m pytest -ra -m real

# Many more generated requests than the suite's bounded run.
fuzz: $(STAMP)
	MLX_PROVIDERS_FUZZ_EXAMPLES=2000 MLX_PROVIDERS_CROSSING_EXAMPLES=2000 $(BIN)/python -m pytest \
		-ra $(XDIST) tests/engine/test_fuzz_engine.py tests/adapters/test_fuzz_adapters.py \
		tests/server/test_fuzz_server.py tests/engine/test_fuzz_crossings.py

lint: $(STAMP)
	$(BIN)/ruff check engine mlx_providers tests testkit bench examples
	$(BIN)/mypy

# BENCH_ARGS go to every script (tests/engine/test_bench.py runs them small, on a tiny model);
# host_overhead builds its own cheap-forward model unless BENCH_ARGS names one.
bench: $(STAMP)
	$(BIN)/python bench/engine_throughput.py $(BENCH_ARGS) $(THROUGHPUT_ARGS)
	$(BIN)/python bench/blas.py $(BENCH_ARGS) $(BLAS_ARGS)
	$(BIN)/python bench/host_overhead.py $(BENCH_ARGS) $(HOST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
