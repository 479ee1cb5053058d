# Session 54: where a qwen3-8b verify step's host time goes at batch 64 (forced alpha 0.8, D-Cut), sync and async: phases, cProfile.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
P="python3 -m metrale.bench.profile_e2e --shape qwen3-8b --batch 64 --alpha 0.8 --forced --dcut --max-tokens 32"
echo "== phases sync" | tee -a $OUT/prof.log
timeout 150 $P --phases 2>&1 | grep -v Warn | tail -45 | tee -a $OUT/prof.log
echo "== phases async" | tee -a $OUT/prof.log
timeout 150 $P --phases --async-scheduling 2>&1 | grep -v Warn | tail -45 | tee -a $OUT/prof.log
echo "== cprofile sync" | tee -a $OUT/cprof.log
timeout 200 $P 2>&1 | grep -v Warn | tail -200 > $OUT/cprof.log
