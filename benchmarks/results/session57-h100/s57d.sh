# Session 57: batch 1, alpha 0.8: last session's code (0251416, in .devsnap/old) against this session's, same machine, alternated.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export METRALE_HOME=/tmp/mh PYTHONUNBUFFERED=1
G="python3 -m metrale.cli bench --shape qwen3-8b --batch-sizes 1 --q 1,2,4 --context 1024 --alpha 0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1 --max-tokens 32 --kv-cache-memory-gb 40 --device cuda"
rm -rf .devsnap/old/metrale/assets; ln -s $PWD/metrale/assets .devsnap/old/metrale/assets
for v in old new old new; do
  if [ $v = old ]; then P=$PWD/.devsnap/old; else P=$PWD; fi
  echo "== $v" | tee -a $OUT/b1.log
  PYTHONPATH=/tmp/site:$P timeout 100 $G --out $OUT/b1-$v 2>&1 | grep --line-buffered "^e2e\|^ \+1 " | tee -a $OUT/b1.log
done
