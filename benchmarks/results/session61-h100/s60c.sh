# Session 60: the start-up CUDA-graph capture of the hybrid (qwen3-next-a3b-64e, 64 sequences, K = 3, write-on-accept): its time and memory with every verify program keeping its own pending rows (e063a0d) and with one shared set (PendingBuffers), one machine; plus the batch-64 forced alpha-0.8 end-to-end figures of each.
. .devsnap/pre.sh
for code in old new; do
  if [ $code = old ]; then root=$PWD/.devsnap/old59; else root=$PWD; fi
  echo "== $code" | tee -a $OUT/bench.log
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 270 python3 -m metrale.cli bench --shape qwen3-next-a3b-64e --device cuda --batch-sizes 64 --q 4 --context 256 --alpha 0.8 --forced-acceptance --num-drafts 3 --e2e-batch-sizes 64 --max-tokens 16 --kv-cache-memory-gb 16 --hybrid-verify-state write_on_accept --out $OUT/bench-$code 2>&1 | grep -v -i warn | tail -25 | tee -a $OUT/bench.log)
done
