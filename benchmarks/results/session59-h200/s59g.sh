# Session 59: the hybrid steady state at batch 64 (qwen3-next-a3b-64e, 256 requests of 24-72 tokens through 64 slots, forced alpha 0.8): the session's starting code (e063a0d: a verify beside prompt chunks as two programs) against the final code (one mixed program), one machine.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for code in old new; do
  if [ $code = old ]; then root=$PWD/.devsnap/old59; else root=$PWD; fi
  echo "== $code" | tee -a $OUT/trace.log
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 200 python3 benchmarks/step_trace.py replay 64 $OUT/trace-$code.json --shape qwen3-next-a3b-64e --alpha 0.8 --max-tokens 48 --requests-per-slot 4 2>&1 | grep -v Warn | tail -4 | tee -a $OUT/trace.log)
done
