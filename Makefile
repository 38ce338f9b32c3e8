# Two commands do the whole set-up on a fresh machine:
#   make test   create .venv, install kvcadence with its test, kernels and ray extras, lint, run the tests
#   make test-fast  the same without the real SGLang worker, the real PrefillAdder and torchrun
#   make demo   create .venv, install, run the main job (kvcadence demo)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcadence-installed
PYTEST_ARGS ?=

.PHONY: venv test test-fast lint demo bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m pip install -q -e '.[test,kernels,ray]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check kvcadence tests bench bench/run
	$(PY) -m ruff format --check kvcadence tests bench bench/run
	$(PY) -m mypy kvcadence

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -m 'not sglang_worker and not sglang_adder and not torchrun' $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvcadence demo

bench: $(STAMP)
	$(PY) bench/run

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
