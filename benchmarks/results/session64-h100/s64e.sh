# Session 64: the split router launch (kernels/moe_router.py): kernel timings, the MoE GPU tests, the hybrid step with and without it (H100).
. .devsnap/pre.sh
timeout 200 python3 benchmarks/moe_kernels.py --batch-sizes 1,4,16,64 2>&1 | grep -v Warn | tee $OUT/moe.json
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py 2>&1 | tail -3 | tee $OUT/gpu.log
B="python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --device cuda --batch-sizes 1,16 --q 1,4 --context 512 --e2e-batch-sizes 1 --max-tokens 8"
for v in True False True False; do
  sed -i "s/^SPLIT_ROUTER = .*/SPLIT_ROUTER = $v/" metrale/models/qwen3_next_moe.py
  echo "== SPLIT_ROUTER=$v" | tee -a $OUT/bench.log
  timeout 170 $B --out $OUT/b-$v 2>&1 | grep --line-buffered -v Warn | grep --line-buffered -v '^{' | head -16 | tee -a $OUT/bench.log
done
sed -i "s/^SPLIT_ROUTER = .*/SPLIT_ROUTER = True/" metrale/models/qwen3_next_moe.py
cp $OUT/b-True/bench.json $OUT/bench-split.json; cp $OUT/b-False/bench.json $OUT/bench-nosplit.json; rm -rf $OUT/b-True $OUT/b-False
