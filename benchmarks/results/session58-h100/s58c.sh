# Session 58: dense prefill programs with quarter-octave row buckets past 128 rows: steady-state step traces (qwen3-8b forced alpha 0.5 / 0.8, batch 64), then the forced grid as s57c (capture count and time in its table).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for a in 0.5 0.8; do
echo "== steady trace alpha $a B64" | tee -a $OUT/trace.log
timeout 150 python3 benchmarks/step_trace.py replay 64 $OUT/trace-steady64-a$a.json --shape qwen3-8b --alpha $a --max-tokens 64 --requests-per-slot 4 2>&1 | grep -v Warn | tail -3 | tee -a $OUT/trace.log
python3 .devsnap/trace_summary.py $OUT/trace-steady64-a$a.json | tee -a $OUT/trace.log
done
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,8,64 --q 1,2,4 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda --steady-requests-per-slot 4"
timeout 380 $G --out $OUT/grid 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | grep --line-buffered -v _warn | tee -a $OUT/grid.log
