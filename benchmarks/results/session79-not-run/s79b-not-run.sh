# Session 79 (b): the one-copy graph inputs (graph_inputs.py) on the GPU: its CUDA test and the dense GPU engine tests (graph replay vs eager, prefill programs, MTP chains, batch 64 K 3, speculation = plain); then qwen3-8b forced D-Cut alpha 0.8 e2e batch 1, this tree, then base (session 78's code, .devsnap/base), one process each.
. .devsnap/pre.sh > $OUT/card.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graph_inputs.py tests/test_gpu.py 2>&1 | grep -v Warn | tail -4 > $OUT/gpu-tests.log
cat $OUT/gpu-tests.log
B="python3 -m metrale.cli bench --shape qwen3-8b --alpha 0.8 --forced-acceptance --dcut --max-tokens 128 --batch-sizes 1 --q 1 --e2e-batch-sizes 1 --device cuda"
run() { echo "== $1" >> $OUT/bench.log
  PYTHONPATH=/tmp/site:$2 timeout 110 $B --out $OUT/h 2>&1 | grep -E "^e2e|captured|^ +1 " >> $OUT/bench.log
  cp $OUT/h/bench.json $OUT/$1.json 2>/dev/null; rm -rf $OUT/h; }
run new $PWD
run base $PWD/.devsnap/base
cat $OUT/bench.log
