# A/B of the gate's calibration (new) against the same estimator without it (old), alternating.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --steady-requests-per-slot 4"
for v in new old new old; do
  cp .devsnap/cal-$v/*.py metrale/speculative/
  echo "== dflash $v" | tee -a $OUT/ab-cal-dflash-$v.log
  timeout 60 $B --e2e-batch-sizes 1,8 --e2e-drafter dflash --num-drafts 7 --out /tmp/b 2>&1 | grep -v Warn | head -8 | tee -a $OUT/ab-cal-dflash-$v.log
done
for v in new old new old; do
  cp .devsnap/cal-$v/*.py metrale/speculative/
  echo "== ngram $v" | tee -a $OUT/ab-cal-ngram-$v.log
  timeout 60 $B --e2e-batch-sizes 8,64 --e2e-drafter ngram --num-drafts 3 --out /tmp/b 2>&1 | grep -v Warn | head -9 | tee -a $OUT/ab-cal-ngram-$v.log
done
