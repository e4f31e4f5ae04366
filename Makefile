# Two commands matter: `make serve` (set up + serve the embedded default) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test venv venv-dev engines bench bench-quick bench-free loadtest loadtest-edits aiperf soak clean llama-server

# The pinned serving stack (requirements.txt) and llama-cpp-python, patched and built from source
# once per user and CPU (tools/llamacpp/install_llama_cpp_python.sh keeps the wheel in ~/.cache/ssd),
# side by side (tools/setup_venv.sh), then this repository's packages (ssd, ssd_tools, ssd_loadtest,
# ssd_openai; see pyproject.toml) installed editable, so every script and test imports them by name.
# `make serve` also fetches and builds the engines while llama.cpp compiles; tests, benches and load
# tests add requirements-dev.txt.
SETUP_ARGS ?=
$(STAMP): requirements.txt pyproject.toml tools/setup_venv.sh tools/llamacpp/install_llama_cpp_python.sh $(wildcard tools/llamacpp/patches/*.patch)
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/setup_venv.sh $(SETUP_ARGS)
	@touch $(STAMP)

DEV_STAMP := $(VENV)/.installed-dev
$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $(DEV_STAMP)

venv: $(STAMP)
venv-dev: $(DEV_STAMP)

# ENGINES: an engines/*.yaml profile (default: the embedded Qwen pair), e.g. make serve ENGINES=engines/my.yaml
ENGINES ?= engines/default.yaml

engines: $(STAMP)
	PYTHON=$(PY) bash build_engines.sh --config $(ENGINES)

# Triton on :8000 (HTTP) / :8001 (gRPC) and the OpenAI-compatible frontend on 127.0.0.1:9000
serve: SETUP_ARGS = --engines $(ENGINES)
serve: engines
	$(PY) tools/serve.py --config $(ENGINES)

test: SETUP_ARGS = --dev
test: $(DEV_STAMP)
	$(PY) -m pytest -v -p no:cacheprovider tests

# AR / SD / SSD served and in-process, the transformers peer, sweeps, plots (results/bench/report.md);
# `make bench` then runs bench-free's three workloads (results/free_drafts/report.md).
bench-quick: engines $(DEV_STAMP)
	$(PY) tools/bench/run.py --preset quick

bench: engines $(DEV_STAMP)
	$(PY) tools/bench/run.py --preset full
	$(PY) tools/bench/free_drafts.py --out results/free_drafts

# free drafts (lookup rounds) on code edits, repeated agent tasks and the mix, against llama-server's
# AR and n-gram speculation and llama-cpp-python's prompt lookup, side by side (results/free_drafts/report.md)
bench-free: engines $(DEV_STAMP)
	$(PY) tools/bench/free_drafts.py --out results/free_drafts

# llama.cpp's llama-server (the bench's llama.cpp peer), built from the pinned llama-cpp-python sdist
# into build/llama.cpp-<version>/ (tools/llamacpp/build_llama_server.sh); bench runs build it if missing.
llama-server: $(STAMP)
	PYTHON=$(PY) bash tools/llamacpp/build_llama_server.sh

clean:
	rm -rf build results

# Locust sweep (concurrency x mode) against a server started here or --url; see README "Load tests".
LOADTEST_ARGS ?=
loadtest: $(DEV_STAMP)
	$(PY) loadtest/sweep.py $(LOADTEST_ARGS)

# The edit workload under load: ours against llama-server AR and its n-gram speculation with N slots,
# 1 / 4 / 16 users (loadtest/peer_sweep.py; results/loadtest_edits/report.md). PEER_LOAD_ARGS: e.g.
# --workload agent, --concurrency 1,4 --run-time 30s for a smoke run.
PEER_LOAD_ARGS ?=
loadtest-edits: engines $(DEV_STAMP)
	$(PY) loadtest/peer_sweep.py --workload edits $(PEER_LOAD_ARGS)

# NVIDIA AIPerf against the OpenAI endpoint of a running `make serve` (small scale; see loadtest/aiperf_run.py).
# Its own venv: AIPerf needs numpy 2, the serving stack numpy 1.26.
AIPERF_VENV := build/aiperf-venv
AIPERF_ARGS ?= --concurrency 2 --requests 16
$(AIPERF_VENV)/.installed: loadtest/aiperf-requirements.txt
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q -r loadtest/aiperf-requirements.txt
	@touch $@

aiperf: $(DEV_STAMP) $(AIPERF_VENV)/.installed
	$(PY) loadtest/aiperf_run.py --tokenizer engines/$$($(PY) -c "import yaml; c = yaml.safe_load(open('$(ENGINES)')); print(next(n for n, e in c['engines'].items() if e['role'] == 'target'))") $(AIPERF_ARGS)

# Mixed traffic for SOAK_ARGS (default 10 minutes at 16 users on the default pair; --tiny: the CI
# engines): requests by outcome, failures, memory of every process start/end, leaked sequences.
SOAK_ARGS ?=
soak: engines $(DEV_STAMP)
	$(PY) loadtest/soak.py $(SOAK_ARGS)
