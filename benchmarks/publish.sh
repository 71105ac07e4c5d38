#!/usr/bin/env bash
# The runs behind the README's headline table, written to results/published/ (each folder: results.json, summary.md
# stamped with machine, date and commit). Run on a quiet machine: about an hour on 2 cores.
#   bash benchmarks/publish.sh [NAME...]     # all, or only the named runs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=results/published
mkdir -p "$OUT"

run() {  # NAME COMMAND...: skipped unless named (or nothing named)
    local name=$1; shift
    if [ ${#SELECTED[@]} -gt 0 ] && [[ ! " ${SELECTED[*]} " =~ " $name " ]]; then return; fi
    echo "== $name: $*"
    # the machine's load beside the numbers (others may share its cores); the log names no one's home folder
    { echo "uptime before: $(uptime)"; "$@" 2>&1; echo "uptime after: $(uptime)"; } | sed "s#$HOME#~#g" \
        | tee "$OUT/$name.log"
}
SELECTED=("$@")

run sweep-8k-x3 $PY -m kvturn.cli bench --compare --scenario sweep --max-prompt-tokens 8192 --repeats 3 \
    --legs pd/P-cache-off,bidir/P-cache-off --out "$OUT/sweep-8k-x3"
run sweep-32k $PY -m kvturn.cli bench --compare --scenario sweep --max-prompt-tokens 32768 --repeats 3 \
    --legs pd/P-cache-off,bidir/P-cache-off --out "$OUT/sweep-32k"
# P's prefix cache on, both pools at 64 MiB (eight 2-8k-token histories do not fit): retention under pressure
run agent-loop-64m $PY -m kvturn.cli bench --compare --scenario agent-loop --legs pd/P-cache-on,bidir/P-cache-on \
    --kv-cache-mb 64 --repeats 3 --out "$OUT/agent-loop-64m"
run coding-agent-32k $PY -m kvturn.cli bench --compare --scenario coding-agent --max-prompt-tokens 32768 \
    --gap-scale 0.1 --legs pd/P-cache-off,bidir/P-cache-off,adaptive --out "$OUT/coding-agent-32k"
run coding-agent $PY -m kvturn.cli bench --compare --scenario coding-agent --max-prompt-tokens 8192 --gap-scale 0.1 \
    --legs pd/P-cache-off,bidir/P-cache-off,adaptive --out "$OUT/coding-agent"
for tokens in 4000 16000 32000; do
    run tpot-$tokens $PY benchmarks/turn_breakdown.py --prompt-tokens $tokens --turns 3 --out "$OUT/tpot-$tokens.json"
done
# P's read of the history layer by layer beside its compute, against the read whole, over a 10 Gbit link between
# network namespaces (UCX over TCP), each held to the summed and the overlapped ideal
run read-overlap-10gbit $PY -m kvturn.cli bench --compare --scenario sweep --max-prompt-tokens 16384 \
    --legs pd/P-cache-off,bidir/P-cache-off,bidir/P-cache-off/whole-read --hosts netns --link 10gbit:50us \
    --out "$OUT/read-overlap-10gbit"
# The answer grid: production scenario on 2P2D, P's cache on, across links and P-pool pressure (netns cells: root)
# (the veth carries ~4.3 Gb/s here, so 10gbit is the unshaped veth and 25/100 Gb/s cells would measure the same)
run production-grid $PY benchmarks/production_grid.py --links shm,10gbit,1gbit --pressures none,0.33 --repeats 3 \
    --plan-links 25gbit,100gbit \
    --sessions 12 --max-prompt-tokens 2048 --out "$OUT/production-grid"
# One cell of it on the real model (P-pool pressure, so that histories are read back): answers equal a run without reuse
run production-grid-smollm2 bash -c "$PY -m kvturn.cli models pull smollm2 && $PY benchmarks/production_grid.py \
    --model smollm2 --links shm --pressures 0.33 --repeats 1 --sessions 8 --max-prompt-tokens 1024 \
    --legs pd/P-cache-on,bidir/P-cache-on --calibrate-on none --out $OUT/production-grid-smollm2"
# The router's choice of P on 2P2D: least-loaded (turns wander between P's caches) against the grid's prefix-affine
run production-least-loaded $PY -m kvturn.cli bench --compare --scenario production --prefill-choice least-loaded \
    --legs pd/P-cache-on,bidir/P-cache-on \
    --sessions 12 --max-prompt-tokens 2048 --gap-scale 0.05 --out "$OUT/production-least-loaded"
run transfer $PY benchmarks/transfer.py --sizes-mib 2,8,32 --out "$OUT/transfer.json"
# The same host MiB spent on P's prefix cache (a host tier) or on D's leases, against P/D and bidir without it
run prefix-host $PY -m kvturn.cli bench --compare --scenario agent-loop --kv-cache-mb 64 \
    --legs pd/P-cache-on,bidir/P-cache-on,pd/P-cache-host,bidir/D-host --out "$OUT/prefix-host"
run memory-pressure $PY benchmarks/memory_pressure.py --rounds 1 --out "$OUT/memory-pressure"
run chaos-soak $PY benchmarks/chaos_soak.py --out "$OUT/chaos-soak.json"
run plan-accuracy $PY benchmarks/plan_accuracy.py --workloads calibration,short-chats,long-agents,sweep \
    --legs colocated,pd/P-cache-off,bidir/P-cache-off --pin-workers --out "$OUT/plan-accuracy"
run demo $PY -m kvturn.cli bench --compare --scenario sweep --max-prompt-tokens 8192 --out "$OUT/demo"
run demo-real bash -c "$PY -m kvturn.cli models pull smollm2 && $PY -m kvturn.cli bench --compare --model smollm2 \
    --scenario real-chat --legs pd/P-cache-off,bidir/P-cache-off --out $OUT/demo-real"
# Large results stay in the repository compressed (zcat them; kvturn plan --calibration wants them unpacked).
find "$OUT" -name results.json -size +200k -exec gzip -9f {} \;
