# Session 53: the qwen3-8b forced grid (D-Cut, K=3) sync against async scheduling: is async worth its vLLM-style default? Then where a hybrid decode step's time goes (bf16 state).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 64 --q 1 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda"
for m in async sync; do
  extra=""; [ "$m" = async ] && extra="--async-scheduling"
  echo "== grid $m" | tee -a $OUT/grid.log
  timeout 190 $G $extra --out $OUT/grid-$m 2>&1 | grep -v Warn | grep -v '^{' | grep -v _warn | tail -22 | tee -a $OUT/grid.log
done
