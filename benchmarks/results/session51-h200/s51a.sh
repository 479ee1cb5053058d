# Issue 14: a ~107M-parameter target trained with `metrale train` (not committed), then its MTP head.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
M=bench-out/m100; rm -rf $M; mkdir -p bench-out
nvidia-smi --query-gpu=name,memory.used --format=csv | tee $OUT/gpu.txt
date +%s > $OUT/t0
python3 -m metrale.cli train target --tokenizer metrale/assets/default-model --out $M --max-bytes 150000000 \
  --hidden-size 768 --num-layers 12 --num-heads 12 --num-kv-heads 4 --head-dim 64 \
  --intermediate-size 3072 --max-position-embeddings 2048 \
  --steps 4000 --batch-size 32 --seq-len 512 --lr 1e-3 --warmup-steps 200 \
  --eval-every 1000 --save-every 0 --max-seconds 330 -q 2>&1 | tail -20 | tee $OUT/train-target.log
cp $M/train_summary.json $OUT/ 2>/dev/null
date +%s >> $OUT/t0
python3 -m metrale.cli train mtp --target $M --max-bytes 150000000 --depths 3 \
  --steps 600 --batch-size 32 --seq-len 512 --lr 1e-3 --warmup-steps 50 \
  --eval-every 300 --save-every 0 --max-seconds 75 -q 2>&1 | tail -20 | tee $OUT/train-mtp.log
cp $M/mtp_train_summary.json $OUT/ 2>/dev/null
date +%s >> $OUT/t0
ls -la $M | tee $OUT/ls.txt
