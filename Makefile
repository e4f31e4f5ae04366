# Two commands matter: `make serve` (set up + serve the embedded default) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test venv engines bench bench-quick loadtest soak clean

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==24.3.1
	$(PY) -m pip install -q -r requirements.txt
	@touch $(STAMP)

venv: $(STAMP)

engines: $(STAMP)
	PYTHON=$(PY) bash build_engines.sh --config engines/default.yaml

serve: engines
	$(PY) tools/serve.py

test: $(STAMP)
	$(PY) -m pytest -v -p no:cacheprovider tests

# AR / SD / SSD served and in-process, the transformers peer, sweeps, plots (results/bench/report.md).
bench-quick: engines
	$(PY) tools/bench/run.py --preset quick

bench: engines
	$(PY) tools/bench/run.py --preset full

clean:
	rm -rf build results

# Locust sweep (concurrency x mode) against a server started here or --url; see README "Load tests".
LOADTEST_ARGS ?=
loadtest: $(STAMP)
	$(PY) loadtest/sweep.py $(LOADTEST_ARGS)

# Mixed traffic for SOAK_ARGS (default 10 minutes at 16 users on the default pair; --tiny: the CI
# engines): requests by outcome, failures, memory of every process start/end, leaked sequences.
SOAK_ARGS ?=
soak: engines
	$(PY) loadtest/soak.py $(SOAK_ARGS)
