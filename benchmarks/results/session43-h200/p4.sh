python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export METRALE_HOME=/tmp/mh
ROOT=$PWD
ln -sfn $ROOT/metrale/assets .devsnap/old/metrale/assets
new() { (cd $ROOT && PYTHONPATH=/tmp/site:$ROOT python3 -m metrale.cli "$@"); }
old() { (cd $ROOT/.devsnap/old && PYTHONPATH=/tmp/site:$ROOT/.devsnap/old python3 -m metrale.cli "$@"); }
D="bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
G="bench --shape qwen3-8b --batch-sizes 64 --q 1 --context 1024 --alpha 0,0.5,0.8 --forced-acceptance --dcut --num-drafts 3 --e2e-batch-sizes 1,8,64 --max-tokens 32 --kv-cache-memory-gb 40"
new $D --e2e-drafter ngram --num-drafts 3 > $OUT/ngram-new.log 2>&1
old $D --e2e-drafter ngram --num-drafts 3 > $OUT/ngram-old.log 2>&1
new $D --e2e-drafter dflash --num-drafts 7 > $OUT/dflash-new.log 2>&1
old $D --e2e-drafter dflash --num-drafts 7 > $OUT/dflash-old.log 2>&1
new $G > $OUT/grid-sync-new.log 2>&1
old $G > $OUT/grid-sync-old.log 2>&1
(cd $ROOT && PYTHONPATH=/tmp/site:$ROOT python3 -m pytest -q -p no:cacheprovider tests/test_dcut_plan_ahead.py tests/test_ngram_catch_up.py > $OUT/gputests.txt 2>&1)
tail -1 $OUT/gputests.txt
ls -la $OUT
