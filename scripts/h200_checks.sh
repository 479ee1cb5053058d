#!/usr/bin/env bash
# One device run that re-checks the GPU paths after a change (run from the repository root on
# the H200; about 5 minutes): the Triton kernels and graph/eager, spec/no-spec tests, the hybrid
# target with and without the Triton delta rule, then the dense (also with D-Cut at batch 64)
# and hybrid bench curves.
# Writes bench JSON/PNG under ${OUT:-bench-out}.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD} METRALE_HOME=${METRALE_HOME:-/tmp/mh}
OUT=${OUT:-bench-out}
python3 -m pytest -q tests/test_kernels.py tests/test_gpu.py tests/test_spec_mtp.py \
  tests/test_hybrid_engine.py tests/test_moe_grouped.py 2>&1 | tail -5
python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,4,16,64 --q 1,2,4,8,16 \
  --context 1024 --e2e-batch-sizes 1,8,64 --max-tokens 48 --kv-cache-memory-gb 24 \
  --out "$OUT/qwen3-8b" 2>&1 | grep -v '^{' | tail -9
python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,16,64 --q 1,2,4 --context 1024 \
  --e2e-batch-sizes 64 --max-tokens 48 --kv-cache-memory-gb 24 --dcut \
  --out "$OUT/qwen3-8b-dcut" 2>&1 | grep -v '^{' | tail -2
for variant in write_on_accept per_row_slots; do
  python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1,2,4 \
    --context 1024 --e2e-batch-sizes 1,16 --max-tokens 32 --kv-cache-memory-gb 16 \
    --hybrid-verify-state "$variant" --out "$OUT/qwen3-next-$variant" 2>&1 | grep -v '^{' | tail -8
done
python3 benchmarks/gdn_verify_variants.py > "$OUT/gdn-verify-variants.json"
