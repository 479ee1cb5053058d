# Session 54: plain decoding with and without async scheduling, alternated in one process: the shipped model (B1/8/64) and the qwen3-8b shape (B1/16/64). Then phases of the shipped model's plain B64 both ways.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
echo "== shipped" | tee -a $OUT/ab.log
timeout 200 python3 scripts/async_scheduling_ab.py --model metrale/assets/default-model --batch-sizes 1,8,64 --out $OUT/ab-shipped.json 2>&1 | grep -v Warn | tail -4 | tee -a $OUT/ab.log
echo "== qwen3-8b" | tee -a $OUT/ab.log
timeout 200 python3 scripts/async_scheduling_ab.py --shape qwen3-8b --batch-sizes 1,16,64 --max-tokens 32 --out $OUT/ab-8b.json 2>&1 | grep -v Warn | tail -4 | tee -a $OUT/ab.log
for m in --async-scheduling --no-async-scheduling; do
  echo "== phases shipped plain B64 $m" | tee -a $OUT/phases.log
  timeout 80 python3 -m metrale.bench.profile_e2e --model metrale/assets/default-model --drafter ngram --batch 64 --max-tokens 64 --phases $m 2>&1 | grep -v Warn | sed -n '/== plain/,/== spec/p' | tee -a $OUT/phases.log
done
