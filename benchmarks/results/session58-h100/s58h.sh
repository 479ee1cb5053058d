# Session 58: issue 14's floor, DFlash K=7 on the shipped model at closed batches 1 and 8, four processes of the final code (no steady state).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
for i in 1 2 3 4; do
  echo "== run $i" | tee -a $OUT/dflash-floor.log
  timeout 50 python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8 --steady-requests-per-slot 0 --e2e-drafter dflash --num-drafts 7 2>&1 | grep --line-buffered -v Warn | sed -n 2,4p | tee -a $OUT/dflash-floor.log
done
