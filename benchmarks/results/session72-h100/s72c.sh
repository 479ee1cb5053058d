# Session 72 (c): GPU tests of held verifies; the qwen3-8b forced cells (D-Cut, K=3, alpha 0 / 0.5 / 0.8, batch 1 / 64) with held verifies on, then off; then where a batch-64 alpha-0.5 verify step's time goes (device busy share and kernels; the device's idle time by host frame from a trace).
. .devsnap/pre.sh > $OUT/card.txt
timeout 70 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_held_verify.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,64 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda"
grid() { # $1 label, $2 METRALE_NO_HELD_VERIFY
  echo "== $1" | tee -a $OUT/grid-ab.log
  METRALE_NO_HELD_VERIFY=$2 timeout 110 $G --out $OUT/g-$1 2>&1 | grep --line-buffered "e2e\|CUDA graphs\|anchor" | tee -a $OUT/grid-ab.log
  cp $OUT/g-$1/bench.json $OUT/grid-$1.json 2>/dev/null; rm -rf $OUT/g-$1
}
grid held 0
grid off 1
P="python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --dcut --batch 64 --max-tokens 32 --alpha 0.5"
timeout 100 $P --kernels 2>&1 | grep -v Warn | grep -v _warn | tail -36 > $OUT/b64-a05-kernels.log


