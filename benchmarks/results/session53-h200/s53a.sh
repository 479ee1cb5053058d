# Session 53, run 1: pending GPU tests, then the shipped-model baseline (n-gram sync and async, MTP), then phase profiles of n-gram B8 and B64.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 200 python3 -m pytest -q -m gpu tests/test_bench.py tests/test_moe_kernels.py tests/test_moe_grouped.py -x 2>&1 | tail -8 | tee $OUT/gpu-tests.log
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "ngram 3 sync" "ngram 3 async" "mtp 3 sync"; do set -- $a
  extra=""; [ "$3" = async ] && extra="--async-scheduling"
  echo "== $1 K=$2 $3" | tee -a $OUT/bench.log
  timeout 90 $B --e2e-drafter $1 --num-drafts $2 $extra --out $OUT/bench-$1-$3.json 2>&1 | grep -v Warn | head -12 | tee -a $OUT/bench.log
done
for b in 8 64; do
  echo "== phases ngram B$b" | tee -a $OUT/phases.log
  timeout 60 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter ngram --batch $b --max-tokens 64 --phases 2>&1 | grep -v Warn | tail -40 | tee -a $OUT/phases.log
done
