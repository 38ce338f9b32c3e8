# Two commands do the whole set-up on a fresh machine:
#   make test   create .venv, install kvcadence with its test, kernels and ray extras, install
#               Debian's chromium when it is missing (make browser), lint, run the tests
#   make test-fast  the same without the real SGLang worker, the real PrefillAdder and torchrun
#   make demo   create .venv, install, run the main job (kvcadence demo)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcadence-installed
# the slowest tests named at the end of every run (where CI's time goes)
PYTEST_ARGS ?= --durations=25
# the tests that need no real SGLang worker run on every core (pytest-xdist, at most 4
# processes); those that drive the real worker (or import the real PrefillAdder) run after
# them, one at a time: a worker's capture is timing, and a second test beside it would load
# the cores it runs on (2 cores on CI: 8 min + ~10 min against ~24 min, one process)
PARALLEL := -n auto --maxprocesses 4
REAL_WORKER := sglang_worker or sglang_adder
CHROMIUM ?= /usr/bin/chromium
BROWSER_FAILED := make browser: chromium is missing and apt-get could not install it (needs root \
and Debian's package sources); install chromium, then rerun

.PHONY: venv browser test test-fast lint demo bench bench-at-size clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m pip install -q -e '.[test,kernels,ray,tokenizer]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check kvcadence tests bench bench/run
	$(PY) -m ruff format --check kvcadence tests bench bench/run
	$(PY) -m mypy kvcadence

# headless Chromium for tests/analysis/test_report_browser.py (renders report.html): Debian's
# package, installed with apt-get only when no chromium is found
browser:
	@if command -v chromium >/dev/null 2>&1 || [ -x $(CHROMIUM) ]; then exit 0; fi; \
	echo "make browser: installing Debian's chromium (apt-get)"; \
	{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
	  >/dev/null || { echo "$(BROWSER_FAILED)" >&2; exit 1; }

test: lint browser
	$(PY) -m pytest $(PARALLEL) -m 'not ($(REAL_WORKER))' $(PYTEST_ARGS)
	$(PY) -m pytest -m '$(REAL_WORKER)' $(PYTEST_ARGS)

test-fast: lint browser
	$(PY) -m pytest $(PARALLEL) -m 'not ($(REAL_WORKER)) and not torchrun' $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvcadence demo

bench: $(STAMP)
	$(PY) bench/run

# the size goals at their size (~10 min here): docs/performance-at-size.md
bench-at-size: $(STAMP)
	$(PY) bench/run --runs 1 --only memory --timeout 1800 --out docs/performance-at-size.md \
		--args 'memory=--only replay report --replay-requests 6000 600000 --report-events 250000 10000000'

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
