# Session 74 (b): the few-row GEMV with all rows in one reduction: tiles against cuBLAS at 1, 2, 4, 8 rows; the hybrid decode and forced-acceptance e2e at batch 1 with the GEMV for up to 8 rows, for 1 row, and off.
. .devsnap/pre.sh > $OUT/card.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv.py tests/test_pdl.py 2>&1 | grep -v Warn | tail -3 > $OUT/gpu-tests.log
timeout 200 python3 benchmarks/gemv_chain.py --rows 1,2,4,8 > $OUT/gemv-chain.json 2> $OUT/gemv-chain.err
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16 --q 1,4 --context 1024 --e2e-batch-sizes 1 --forced-acceptance --alpha 0.8 --num-drafts 3 --device cuda"
hyb() { echo "== $1" >> $OUT/hybrid.log
  METRALE_NO_GEMV=$2 timeout 110 $H --out $OUT/h 2>&1 | grep -v Warn | grep -v _warn | grep -v '^{' | tail -9 >> $OUT/hybrid.log
  cp $OUT/h/bench.json $OUT/hybrid-$1.json 2>/dev/null; rm -rf $OUT/h; }
hyb rows8 0
hyb cublas 1
sed -i 's/^MAX_ROWS = 8 /MAX_ROWS = 1 /' metrale/kernels/gemv.py; grep -n "^MAX_ROWS" metrale/kernels/gemv.py >> $OUT/hybrid.log
hyb rows1 0
