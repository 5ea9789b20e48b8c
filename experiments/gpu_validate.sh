#!/usr/bin/env bash
# The GPU check: calibrate this GPU, then simulate and execute every policy under both
# implementation presets (as-published and ideal) and report the errors. Target: under 8 minutes
# on one GPU (RTX 3090 / H100 / H200 / H800). Results go to experiments/results/<gpu-name>/ (and to
# $OUT when set, as on the device machine).
#
# Runs from the checkout without `pip install`: PYTHONPATH is the checkout. Where simpy/pydantic
# are missing (the device machine), put their wheels in .whl/ (see experiments/README.md) and they
# are installed into /tmp/site first.
#
#   bash experiments/gpu_validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import simpy, pydantic" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  else
    echo "simpy/pydantic missing and no wheels in .whl/: see experiments/README.md" >&2; exit 2
  fi
fi
python3 - <<'PY' || { echo "no CUDA GPU visible to torch: nothing to do" >&2; exit 2; }
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PY
GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
OUT_DIR="experiments/results/$GPU"
mkdir -p "$OUT_DIR"
start=$(date +%s)
{
  echo "# GPU validation on $GPU"
  echo
  echo "Produced by \`bash experiments/gpu_validate.sh\` on $(date -u +%Y-%m-%dT%H:%MZ)."
  python3 -c "import torch, transformers; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')"
  echo
} > "$OUT_DIR/README.md"

runtime() { python3 -m klotski_runtime.cli "$@"; }
run() { echo "+ klotski-runtime $*" | tee -a "$OUT_DIR/log.txt"; runtime "$@" 2>&1 | tee -a "$OUT_DIR/log.txt"; }

# 1. small-mixtral (whole model): calibrate, then all policies, both presets
run calibrate --device cuda --model small-mixtral --batch-sizes 1,4,8,16 --prompt-lens 64,128 \
    --max-expert-tokens 2048 --out "$OUT_DIR/profile-small-mixtral.yaml"
run validate --policy all --impl both --repeats 3 --device cuda --model small-mixtral \
    --profile "$OUT_DIR/profile-small-mixtral.yaml" --batch-size 16 --num-batches 4 --prompt-len 128 --gen-len 8 \
    --out "$OUT_DIR/small-mixtral"

# 2. Mixtral-8x7B shapes, first 4 of 32 layers (random weights of the true shapes)
run calibrate --device cuda --model mixtral-8x7b:4 --batch-sizes 1,4,16 --prompt-lens 64,128 \
    --max-expert-tokens 2048 --out "$OUT_DIR/profile-mixtral-8x7b.yaml"
run validate --policy all --impl both --repeats 3 --device cuda --model mixtral-8x7b:4 \
    --profile "$OUT_DIR/profile-mixtral-8x7b.yaml" --batch-size 16 --num-batches 4 --prompt-len 128 --gen-len 8 \
    --out "$OUT_DIR/mixtral-8x7b-4layers"

{
  echo "## Results"
  echo
  echo '```'
  grep -A16 "^policy" "$OUT_DIR/log.txt" || true
  echo '```'
  echo
  echo "Wall time: $(( $(date +%s) - start )) s."
} >> "$OUT_DIR/README.md"
if [ -n "${OUT:-}" ]; then  # the device machine brings back what is under $OUT
  cp "$OUT_DIR"/README.md "$OUT_DIR"/log.txt "$OUT_DIR"/profile-*.yaml "$OUT/" 2>/dev/null || true
  cp "$OUT_DIR"/small-mixtral/validation.json "$OUT/small-mixtral-validation.json" 2>/dev/null || true
  cp "$OUT_DIR"/mixtral-8x7b-4layers/validation.json "$OUT/mixtral-8x7b-validation.json" 2>/dev/null || true
fi
echo "wrote $OUT_DIR/"
