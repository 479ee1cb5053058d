# Session 54: the shipped model's drafters under the new default (async scheduling on): n-gram K=3, DFlash K=7, MTP K=3 (MTP keeps the engine synchronous).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "ngram 3" "dflash 7" "mtp 3"; do set -- $a
  echo "== $1 K=$2 (default: async)" | tee -a $OUT/drafters.log
  timeout 150 $B --e2e-drafter $1 --num-drafts $2 --out $OUT/bench-$1 2>&1 | grep -v Warn | head -14 | tee -a $OUT/drafters.log
done
