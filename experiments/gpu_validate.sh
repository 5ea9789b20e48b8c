#!/usr/bin/env bash
# The GPU check: calibrate this GPU, then simulate and execute every policy on it and report the
# errors. Target: under 8 minutes on one GPU. Results go to experiments/results/<gpu-name>/.
#
#   bash experiments/gpu_validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY' || { echo "no CUDA GPU visible to torch: nothing to do" >&2; exit 2; }
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PY
GPU=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
OUT="experiments/results/$GPU"
mkdir -p "$OUT"
start=$(date +%s)
{
  echo "# GPU validation on $GPU"
  echo
  echo "Produced by \`bash experiments/gpu_validate.sh\` on $(date -u +%Y-%m-%dT%H:%MZ)."
  python -c "import torch, transformers; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')"
  echo
} > "$OUT/README.md"

run() { echo "+ $*" | tee -a "$OUT/log.txt"; "$@" 2>&1 | tee -a "$OUT/log.txt"; }

# 1. small-mixtral (whole model): calibrate, then all policies
run klotski-runtime calibrate --device cuda --model small-mixtral --batch-sizes 1,4,8,16 --prompt-lens 32,128 \
    --max-expert-tokens 2048 --out "$OUT/profile-small-mixtral.yaml"
run klotski-runtime validate --policy all --device cuda --model small-mixtral \
    --profile "$OUT/profile-small-mixtral.yaml" --batch-size 16 --num-batches 4 --prompt-len 128 --gen-len 8 \
    --out "$OUT/small-mixtral"

# 2. Mixtral-8x7B shapes, first 4 of 32 layers (random weights of the true shapes)
run klotski-runtime calibrate --device cuda --model mixtral-8x7b:4 --batch-sizes 1,4,16 --prompt-lens 128 \
    --max-expert-tokens 2048 --out "$OUT/profile-mixtral-8x7b.yaml"
run klotski-runtime validate --policy all --device cuda --model mixtral-8x7b:4 \
    --profile "$OUT/profile-mixtral-8x7b.yaml" --batch-size 16 --num-batches 4 --prompt-len 128 --gen-len 8 \
    --out "$OUT/mixtral-8x7b-4layers"

{
  echo "## Results"
  echo
  echo '```'
  grep -A8 "^policy" "$OUT/log.txt" || true
  echo '```'
  echo
  echo "Wall time: $(( $(date +%s) - start )) s."
} >> "$OUT/README.md"
echo "wrote $OUT/"
