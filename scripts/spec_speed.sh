#!/usr/bin/env bash
# The speculative-speed grid of issue 12 in one device run (H200, about 8 minutes): the
# qwen3-8b shape with D-Cut at forced acceptance alpha in {0, 0.5, 0.8} and batch 1/8/64, the
# same without D-Cut at alpha 0.8 batch 1 (against the ideal), and the shipped default model
# with its MTP head and with n-gram at batch 1/8/64. JSON and PNG under ${OUT:-bench-out}.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD} METRALE_HOME=${METRALE_HOME:-/tmp/mh} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
run() { name=$1; shift; timeout 300 python3 -m metrale.cli bench "$@" --out "$OUT/$name" 2>&1 \
  | grep -v '^{' | tail -14; }
run qwen3-8b-dcut-forced --shape qwen3-8b --batch-sizes 1,8,64 --q 1,2,3,4 --context 1024 \
  --e2e-batch-sizes 1,8,64 --max-tokens 64 --alpha 0,0.5,0.8 --forced-acceptance --dcut \
  --num-drafts 3 --kv-cache-memory-gb 24
run qwen3-8b-k3-forced --shape qwen3-8b --batch-sizes 1 --q 1,4 --context 1024 \
  --e2e-batch-sizes 1 --max-tokens 64 --alpha 0.8 --forced-acceptance --num-drafts 3 \
  --kv-cache-memory-gb 24
for d in mtp ngram; do
  run default-$d --e2e-drafter $d --model metrale/assets/default-model --e2e-batch-sizes 1,8,64 \
    --num-drafts 3 --max-tokens 64 --device cuda
done
