#!/usr/bin/env bash
# D-Cut pricing the drafter's measured host work against pricing verify rows only
# (METRALE_NO_DCUT_HOST_COST=1), on the shipped model with n-gram and MTP at batch 1/8/64, in one
# device run (H200, about 6 minutes). JSON per run under ${OUT:-bench-out}.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD} METRALE_HOME=${METRALE_HOME:-/tmp/mh} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
for d in ${DRAFTERS:-ngram mtp}; do
  for mode in ${MODES:-priced rows}; do
    if [ $mode = rows ]; then export METRALE_NO_DCUT_HOST_COST=1; else unset METRALE_NO_DCUT_HOST_COST; fi
    echo "== $d, D-Cut prices: $mode"
    timeout 280 python3 -m metrale.cli bench --e2e-drafter $d --model metrale/assets/default-model \
      --e2e-batch-sizes 1,8,64 --num-drafts 3 --max-tokens 64 --device cuda \
      --out "/tmp/bench-$d-$mode" 2>&1 | grep -v '^{' | tail -9
    cp "/tmp/bench-$d-$mode/drafter_e2e.json" "$OUT/default-$d-$mode.json"
  done
done
