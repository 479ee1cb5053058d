source .devsnap/pre.sh
python3 -m metrale.cli bench --shape qwen3-8b --alpha 0,0.5,0.8 --forced-acceptance --dcut --max-tokens 128 --batch-sizes 1,8,64 --e2e-batch-sizes 1,8,64 --out $OUT/grid > $OUT/s78b-grid.log 2>&1
grep -E "^e2e|captured|^ +(1|8|64) " $OUT/s78b-grid.log
