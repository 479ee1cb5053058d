# Session 72 (f): after 774b98f (D-Cut learns held verdicts at their read), the qwen3-8b forced batch-64 cells (D-Cut, K=3, alpha 0.5 / 0.8), held verifies on / off alternated twice more.
. .devsnap/pre.sh > $OUT/card.txt
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 1024 --alpha 0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda"
grid() { echo "== $1" | tee -a $OUT/grid-ab.log
  METRALE_NO_HELD_VERIFY=$2 timeout 80 $G --out $OUT/g 2>&1 | grep --line-buffered "^e2e" | tee -a $OUT/grid-ab.log; rm -rf $OUT/g; }
grid held 0; grid off 1; grid held 0; grid off 1
