# `make test` and `make demo` set everything up themselves, idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export KVTURN_CACHE_DIR ?= $(CURDIR)/.kvturn-cache

.PHONY: install test demo bench-engine bench-transfer clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: anything else may pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q tests

# Five deployment legs on the embedded model, prompts swept to 8k tokens; ~3 min on 2 cores.
demo: install
	$(PY) -m kvturn.cli bench --compare --scenario sweep --max-prompt-tokens 8192 --out results/demo

bench-engine: install
	$(PY) benchmarks/engine.py

bench-transfer: install
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV) .kvturn-cache results
