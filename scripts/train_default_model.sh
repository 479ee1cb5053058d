#!/usr/bin/env bash
# The recipe of metrale's shipped default model (MODEL_CARD.md): a byte-level BPE tokenizer, a
# small Qwen3 target, its MTP head and its DFlash drafter (dflash/), trained on the .py files of the installed packages.
# Usage: scripts/train_default_model.sh OUT_DIR [extra target flags]; run on one GPU.
set -euo pipefail
OUT=${1:?usage: train_default_model.sh OUT_DIR}
shift
WORK=$(mktemp -d)
metrale() { python3 -m metrale.cli "$@"; }

metrale train tokenizer --out "$WORK/tok" --vocab-size 4096 --max-bytes 40000000 -q
metrale train target --tokenizer "$WORK/tok" --out "$OUT" --max-bytes 150000000 \
  --hidden-size 384 --num-layers 6 --num-heads 6 --num-kv-heads 2 --head-dim 64 \
  --intermediate-size 1024 --max-position-embeddings 2048 \
  --steps 2500 --batch-size 64 --seq-len 512 --lr 2e-3 --warmup-steps 200 \
  --eval-every 500 --save-every 0 --max-seconds 270 -q "$@"
metrale train mtp --target "$OUT" --max-bytes 150000000 --depths 3 \
  --steps 800 --batch-size 32 --seq-len 512 --lr 2e-3 --warmup-steps 50 \
  --eval-every 400 --save-every 0 --max-seconds 90 -q
metrale train dflash --target "$OUT" --max-bytes 150000000 --block-size 8 \
  --num-draft-layers 3 --target-layers 1,3,5 --anchor-stride 8 --steps 11000 --batch-size 32 \
  --seq-len 512 --lr 2e-3 --warmup-steps 200 --eval-every 2500 --save-every 0 \
  --max-seconds 470 -q
# a second run from those weights, at half the learning rate (K = 7 acceptance 3.47 -> 3.56)
metrale train dflash --target "$OUT" --init "$OUT/dflash" --max-bytes 150000000 --block-size 8 \
  --num-draft-layers 3 --target-layers 1,3,5 --anchor-stride 8 --steps 11000 --batch-size 32 \
  --seq-len 512 --lr 1e-3 --warmup-steps 100 --eval-every 2500 --save-every 0 \
  --max-seconds 430 -q
