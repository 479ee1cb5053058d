# Session 76 (f): the tensor-core kernel's tiles at 4 rows on the qwen3-8b projections (bn/bk/stages/warps), against cuBLAS and the one-row GEMV.
. .devsnap/pre.sh > $OUT/card.txt 2>&1
timeout 190 python3 benchmarks/gemv_chain.py --rows 1,4 --shapes 8b.down_proj,8b.o_proj,8b.qkv,8b.gate_up --strips 4096 --dot-bn 16,32,64 --dot-bk 128,256 --dot-stages 4,5 --dot-warps 4,8 > $OUT/tiles.txt 2>&1
grep "rows" $OUT/tiles.txt | grep -v '"' 
