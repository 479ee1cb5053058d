# Session 58: the shipped model's n-gram and MTP drafters (K=3) with the final code, closed batches 1 / 8 / 64 and steady state, default async scheduling (as s56b, DFlash left out for device time).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "ngram 3" "mtp 3"; do set -- $a
  echo "== $1 K=$2 (default: async)" | tee -a $OUT/drafters.log
  timeout 160 $B --e2e-drafter $1 --num-drafts $2 --out $OUT/bench-$1 2>&1 | grep --line-buffered -v Warn | head -16 | tee -a $OUT/drafters.log
done
