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

demo: install
	$(PY) benchmarks/demo_chat.py

bench-engine: install
	$(PY) benchmarks/engine.py

bench-transfer: install
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV) .kvturn-cache results
