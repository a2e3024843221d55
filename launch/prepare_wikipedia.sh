#!/usr/bin/env bash
# English Wikipedia -> packed, tokenized ArrayRecord rows on gs://, once, for every later run.
#
#   BUCKET=gs://MY_BUCKET launch/prepare_wikipedia.sh [extra flags for tacl_jax.data.prepare]
#
# Steps (each printed before it runs):
#   1. the TFDS dataset wikipedia/20230601.en in ArrayRecord format: taken from TFDS_DIR when it
#      is there (gs:// is copied to LOCAL_DIR first), else built when BUILD_TFDS=1
#      (`tfds build`, an Apache Beam job: hours on a large CPU VM; needs tensorflow-datasets,
#      apache-beam and mwparserfromhell)
#   2. the tokenizer: HF_PATH, or the Hub model HF_MODEL downloaded into LOCAL_DIR
#   3. `python -m tacl_jax.data.prepare` into a local folder (prepare writes local paths only)
#   4. `gcloud storage rsync` of that folder to OUT (gs://)
# Then train on it: DATA=$OUT launch/tpu_vm.sh setup train   (or copy it next to a GPU host).
#
# Environment variables (defaults in brackets):
#   BUCKET (gs://..., for the defaults below)      CONFIG [configs/base.py]: max_len, packing
#   TFDS_NAME [wikipedia/20230601.en]   TFDS_DIR [$BUCKET/tfds]: TFDS data_dir, gs:// or local
#   BUILD_TFDS [0]: 1 = build the TFDS dataset into TFDS_DIR when it is missing
#   HF_MODEL [bert-base-uncased]   HF_PATH: a local tokenizer folder instead of downloading HF_MODEL
#   LOCAL_DIR [/tmp/tacl_prepare]: scratch (Wikipedia: ~20 GB of TFDS in, roughly 5 bytes per
#             token out, ~25-30 GB; ~80 GB free is comfortable)
#   NAME [wiki_l256]   OUT [$BUCKET/data/$NAME]   NUM_SHARDS [64]   WORKERS [nproc]
#   PYTHON [python]   DRY_RUN [0]: 1 = print every command, run none
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUCKET=${BUCKET:-}
BUCKET=${BUCKET%/}
CONFIG=${CONFIG:-configs/base.py}
TFDS_NAME=${TFDS_NAME:-wikipedia/20230601.en}
TFDS_DIR=${TFDS_DIR:-${BUCKET:+$BUCKET/tfds}}
TFDS_DIR=${TFDS_DIR%/}
BUILD_TFDS=${BUILD_TFDS:-0}
HF_MODEL=${HF_MODEL:-bert-base-uncased}
HF_PATH=${HF_PATH:-}
LOCAL_DIR=${LOCAL_DIR:-/tmp/tacl_prepare}
NAME=${NAME:-wiki_l256}
OUT=${OUT:-${BUCKET:+$BUCKET/data/$NAME}}
OUT=${OUT%/}
NUM_SHARDS=${NUM_SHARDS:-64}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 8)}
PYTHON=${PYTHON:-python}
DRY_RUN=${DRY_RUN:-0}

if [ -z "$TFDS_DIR" ] || [ -z "$OUT" ]; then
  echo "set BUCKET=gs://... (or TFDS_DIR and OUT)" >&2; exit 2
fi

# quote, run: print each command, run it unless DRY_RUN=1.
# shellcheck source=launch/commands.sh disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/commands.sh"
say() { printf '\n== %s\n' "$*"; }
exists() {  # exists PATH: a local path or a gs:// prefix with at least one object
  case "$1" in
    gs://*) gcloud storage ls "$1" >/dev/null 2>&1 ;;
    *) [ -e "$1" ] ;;
  esac
}

# 1. The TFDS dataset (ArrayRecord), local.
say "1. TFDS $TFDS_NAME (ArrayRecord) from $TFDS_DIR"
if [ "$DRY_RUN" != 1 ] && ! exists "$TFDS_DIR/$TFDS_NAME"; then
  if [ "$BUILD_TFDS" != 1 ]; then
    echo "$TFDS_DIR/$TFDS_NAME does not exist. Build it once (BUILD_TFDS=1 runs this):" >&2
    echo "  tfds build $TFDS_NAME --data_dir=$TFDS_DIR --file_format=array_record" >&2
    exit 1
  fi
  run tfds build "$TFDS_NAME" --data_dir="$TFDS_DIR" --file_format=array_record
fi
case "$TFDS_DIR" in
  gs://*)
    LOCAL_TFDS=$LOCAL_DIR/tfds
    run mkdir -p "$LOCAL_TFDS/$TFDS_NAME"
    run gcloud storage rsync --recursive "$TFDS_DIR/$TFDS_NAME" "$LOCAL_TFDS/$TFDS_NAME"
    ;;
  *) LOCAL_TFDS=$TFDS_DIR ;;
esac

# 2. The tokenizer (its vocabulary fingerprint is stored with the rows and checked at training).
if [ -z "$HF_PATH" ]; then
  HF_PATH=$LOCAL_DIR/models/${HF_MODEL##*/}
  say "2. tokenizer: Hugging Face $HF_MODEL -> $HF_PATH"
  run "$PYTHON" -c "from huggingface_hub import snapshot_download; snapshot_download('$HF_MODEL', local_dir='$HF_PATH', allow_patterns=['*.json', '*.txt', '*.safetensors'])"
else
  say "2. tokenizer: $HF_PATH"
fi

# 3. Tokenize and pack.
LOCAL_OUT=$LOCAL_DIR/$NAME
say "3. prepare -> $LOCAL_OUT ($NUM_SHARDS shards, $WORKERS workers)"
run "$PYTHON" -m tacl_jax.data.prepare --config="$CONFIG" \
  --config.data.source="tfds:$TFDS_NAME" --config.data.data_dir="$LOCAL_TFDS" \
  --config.data.num_shards="$NUM_SHARDS" --config.init.hf_path="$HF_PATH" \
  --out="$LOCAL_OUT" --workers="$WORKERS" "$@"

# 4. Upload.
say "4. upload -> $OUT"
case "$OUT" in
  gs://*) run gcloud storage rsync --recursive "$LOCAL_OUT" "$OUT" ;;
  *) run mkdir -p "$OUT"; run cp -r "$LOCAL_OUT/." "$OUT/" ;;
esac
echo
echo "# done. Train on it: DATA=$OUT launch/tpu_vm.sh setup train   (see launch/README.md)"
