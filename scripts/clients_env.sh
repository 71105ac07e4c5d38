#!/usr/bin/env bash
# Creates a venv with the field's outside benchmark clients, NVIDIA's AIPerf and ABench (agentic-bench), from the
# package registry, unchanged, for `make test-clients` (tests/test_clients.py). Idempotent: a stamp file makes a second
# run do nothing. About 1 GB (AIPerf brings transformers, pandas, plotly; no torch); a few minutes.
#
#   CLIENTS_VENV   venv path, relative to the repo root unless absolute (default .venv-clients)
#   PYTHON         interpreter for the venv (default python3.11, else python3)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${CLIENTS_VENV:-.venv-clients}
WANT="aiperf==0.13.0 agentic-bench==0.2.0"
STAMP="$VENV/.clients-installed-stamp"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "clients_env: $VENV already has $WANT (stamp $STAMP); nothing to do"
  exit 0
fi

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $WANT
"$VENV/bin/aiperf" --version
"$VENV/bin/abench" --version
echo "$WANT" > "$STAMP"
