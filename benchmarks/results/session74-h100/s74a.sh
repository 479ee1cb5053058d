# Session 74 (a): the few-row GEMV (kernels/gemv.py): tiles against cuBLAS in a norm->projection chain; the hybrid decode step with the GEMV on / off (METRALE_NO_GEMV=1); its CPU-pinned tests on the GPU.
. .devsnap/pre.sh > $OUT/card.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
timeout 200 python3 benchmarks/gemv_chain.py --rows 1,4,8 > $OUT/gemv-chain.json 2> $OUT/gemv-chain.err
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1,4 --context 1024 --device cuda"
hyb() { echo "== $1" >> $OUT/hybrid.log
  METRALE_NO_GEMV=$2 timeout 130 $H --out $OUT/h 2>&1 | grep -v Warn | grep -v _warn | grep -v '^{' | tail -7 >> $OUT/hybrid.log
  cp $OUT/h/bench.json $OUT/hybrid-$1.json 2>/dev/null; rm -rf $OUT/h; }
hyb gemv 0
hyb cublas 1
