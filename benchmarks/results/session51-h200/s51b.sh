# Issue 14: the DFlash drafter for the ~107M target of s51a.sh, then DFlash / MTP / n-gram speedups in one run.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
M=bench-out/m100
ls $M/config.json || { echo "NO MODEL (machine was given back)"; exit 3; }
date +%s > $OUT/t0
python3 -m metrale.cli train dflash --target $M --max-bytes 150000000 --block-size 8 \
  --num-draft-layers 2 --target-layers 1,6,10 --anchor-stride 8 --steps 5000 --batch-size 32 \
  --seq-len 512 --lr 2e-3 --warmup-steps 200 --eval-every 2500 --save-every 0 \
  --max-seconds 210 -q 2>&1 | tail -20 | tee $OUT/train-dflash.log
cp $M/dflash/dflash_train_summary.json $OUT/ 2>/dev/null
date +%s >> $OUT/t0
B="python3 -m metrale.cli bench --model $M --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for d in "dflash 7" "mtp 3" "ngram 3"; do set -- $d
  echo "== $1 K=$2" | tee -a $OUT/bench-m100.log
  timeout 100 $B --e2e-drafter $1 --num-drafts $2 --out /tmp/b-$1 2>&1 | grep -v Warn | tail -25 | tee -a $OUT/bench-m100.log
  cp /tmp/b-$1/drafter_e2e.json $OUT/e2e-$1.json 2>/dev/null
done
date +%s >> $OUT/t0
