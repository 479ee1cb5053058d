# Session 70: A/B of the shipped model's n-gram cells (and MTP batch 1) between this code and session 65's (5125584, carried in .ab65/), interleaved to see host noise.
. .devsnap/pre.sh > $OUT/card.txt
SITE=$PYTHONPATH
cp -r metrale/assets .ab65/metrale/
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --steady-requests-per-slot 4"
run() { # $1 label, $2 root, $3 drafter, $4 batches
  echo "== $1 $3 B=$4" | tee -a $OUT/ab.log
  (cd $2 && PYTHONPATH=/tmp/site:$PWD timeout 150 $B --e2e-drafter $3 --num-drafts 3 --e2e-batch-sizes $4 --out $OUT/b-$1-$3 2>&1 | grep --line-buffered -v Warn | grep -v _warn_once | head -14 | tee -a $OUT/ab.log)
  cp $OUT/b-$1-$3/drafter_e2e.json $OUT/$1-$3-$5.json 2>/dev/null; rm -rf $OUT/b-$1-$3
}
run new $PWD ngram 8,64 r1
run old $PWD/.ab65 ngram 8,64 r1
run new $PWD ngram 8,64 r2
run old $PWD/.ab65 ngram 8,64 r2
run new $PWD mtp 1 r1
run old $PWD/.ab65 mtp 1 r1
