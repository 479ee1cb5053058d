# Session 54: step traces of the qwen3-8b forced grid's batch-64 cells, async (alpha 0.5: 0.67x) and sync.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
for c in "0.5 --async-scheduling" "0.5 --no-async-scheduling" "0.0 --async-scheduling"; do set -- $c
  tag=a$1$2
  echo "== $tag" | tee -a $OUT/trace.log
  timeout 170 python3 benchmarks/step_trace.py replay 64 $OUT/trace-$tag.json --shape qwen3-8b --alpha $1 $2 --max-tokens 32 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
done
