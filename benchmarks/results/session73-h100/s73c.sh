# Session 73 (c): programmatic dependent launch (kernels/pdl.py) on the hybrid shape's decode step: bench with PDL on / off (METRALE_NO_PDL=1), then the GPU tests of the kernels and the hybrid engine with PDL on.
. .devsnap/pre.sh > $OUT/card.txt
python3 -c "import triton; from triton.language.extra.cuda import gdc_wait; print('triton', triton.__version__, 'gdc ok')" >> $OUT/card.txt 2>&1
H="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --batch-sizes 1,16,64 --q 1,4 --context 1024 --device cuda"
hyb() { echo "== $1" >> $OUT/hybrid.log
  METRALE_NO_PDL=$2 timeout 140 $H --out $OUT/h 2>&1 | grep -v Warn | grep -v _warn | grep -v '^{' | tail -7 >> $OUT/hybrid.log
  cp $OUT/h/bench.json $OUT/hybrid-$1.json 2>/dev/null; rm -rf $OUT/h; }
hyb pdl 0
hyb off 1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_hybrid_kernels_gpu.py tests/test_moe_kernels.py tests/test_moe_grouped.py tests/test_gpu.py 2>&1 | grep -v Warn | tail -6 > $OUT/gpu-tests.log
