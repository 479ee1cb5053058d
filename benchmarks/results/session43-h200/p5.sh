python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export METRALE_HOME=/tmp/mh PYTHONPATH=/tmp/site:$PWD
D="bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
python3 -m metrale.cli $D --e2e-drafter ngram --num-drafts 3 > $OUT/ngram-final.log 2>&1
python3 -m metrale.cli $D --e2e-drafter dflash --num-drafts 7 > $OUT/dflash-final.log 2>&1
ls $OUT
