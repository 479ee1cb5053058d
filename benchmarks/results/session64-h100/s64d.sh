# Session 64: the routing launch's warps (1, 2, 4, 8), H100.
. .devsnap/pre.sh
timeout 300 python3 .devsnap/route_ab.py 2>&1 | grep -v Warn | tee $OUT/route_warps.json
