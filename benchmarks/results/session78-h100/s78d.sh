# Session 78 (d): where n-gram (and MTP) speculative output leaves plain output on the shipped model, bf16, and with --deterministic.
. .devsnap/pre.sh > $OUT/card.txt
timeout 150 python3 .devsnap/divergence.py ngram 2>&1 | grep -v Warn | tee $OUT/div-ngram.log
timeout 150 python3 .devsnap/divergence.py ngram --deterministic 2>&1 | grep -v Warn | tee $OUT/div-ngram-det.log
timeout 150 python3 .devsnap/divergence.py mtp 2>&1 | grep -v Warn | tee $OUT/div-mtp.log
