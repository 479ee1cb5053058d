# Session 73 (d): PDL's GPU tests (and the hybrid engine's, the deterministic mode's, held verifies') with PDL on; the dense qwen3-8b decode step with PDL on / off; the grouped MoE kernels' tiles swept on the H100 (BN, BK, warps, stages) at batch 1 / 16 / 64.
. .devsnap/pre.sh > $OUT/card.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py tests/test_hybrid_engine.py tests/test_deterministic.py tests/test_held_verify.py 2>&1 | grep -v Warn | tail -8 > $OUT/gpu-tests.log
D="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1,64 --q 1,4 --context 1024 --kv-cache-memory-gb 40 --device cuda"
for m in 0 1; do echo "== METRALE_NO_PDL=$m" >> $OUT/dense.log; METRALE_NO_PDL=$m timeout 90 $D --out $OUT/d 2>&1 | grep -v Warn | grep -v _warn | grep -v '^{' | tail -5 >> $OUT/dense.log; rm -rf $OUT/d; done
PYTHONPATH=$PYTHONPATH:. timeout 200 python3 .devsnap/moe_sweep.py --batch-sizes 1,16,64 --sweep > $OUT/moe-sweep.json 2> $OUT/moe-sweep.err
