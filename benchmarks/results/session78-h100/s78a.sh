source .devsnap/pre.sh
git log --oneline | head -1
python3 -m metrale.cli bench --shape qwen3-8b --alpha 0.5,0.8 --forced-acceptance --dcut --max-tokens 128 --batch-sizes 1,64 --e2e-batch-sizes 1,64 --out $OUT/grid > $OUT/s77c-grid.log 2>&1
grep -E "^e2e|captured|^ +(1|64) " $OUT/s77c-grid.log
P="python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --dcut --max-tokens 128 --phases"
$P --batch 1 --alpha 0.8 --max-model-len 1344 --max-num-seqs 64 > $OUT/s77c-phases-b1-benchcfg.log 2>&1
$P --batch 1 --alpha 0.8 > $OUT/s77c-phases-b1-small.log 2>&1
grep -E "^== |LLMEngine.step|execute|CUDAGraph|load|pack_spans|to_device|to_host|prepare|hold|schedule" $OUT/s77c-phases-*.log
