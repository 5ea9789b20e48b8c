#!/usr/bin/env bash
# The GPU check: calibrate this GPU, then simulate and execute every policy under both
# implementation presets (as-published and ideal) and report the errors; KV offload (pinned, async)
# is checked on its own. Target: under 7 minutes on one GPU (RTX 3090 / H100 / H200 / H800). On an
# H200 its steps took 14 + 39 + 23 + 52 s, and the last one 100 s with --repeats 1 (so ~250 s with 3).
# Results go to experiments/results/<gpu-name>/ (and to $OUT when set, as on the device machine).
#
# Every step has a time limit and a failed step does not stop the next one: one short lease on a
# GPU should bring back everything that worked, and the traceback of anything that did not.
#
# Runs from the checkout without `pip install`: PYTHONPATH is the checkout. Where pydantic
# is missing (the device machine), put its wheels in .whl/ (see experiments/README.md) and they
# are installed into /tmp/site first.
#
#   bash experiments/gpu_validate.sh [all|ladder|ladder-small|cpu-experts|serving]
#
# `lease` (what one short device lease runs, in this order): cpu-experts, ladder-small, serving.
# `ladder-small` is the ladder's small-mixtral half (about 80 s on an H200); `serving` validates the
# serving policies (vllm, vllm-o, ktransformers, fluxmoe-h, fluxmoe) with `validate --serve`.
#
# `cpu-experts` checks the schedules that compute cold experts on the host CPU (fiddler,
# llamacpp-moe, klotski-hybrid, next to klotski) against the CUDA executor, with the GPU's memory
# capped in the profile so that some experts must stay in host memory.
#
# DEVICE=cpu runs it without a GPU (a dry run: the numbers are the CPU's). QUICK=1 runs every step
# on tiny-mixtral at the smallest sizes with one repeat, each model calibrated once, into a fresh
# temporary folder unless OUT_DIR is given: a check that the script works, not a measurement
# (`DEVICE=cpu QUICK=1 bash experiments/gpu_validate.sh cpu-experts` is the test's; on a CPU the
# calibration's dispatch probes alone take ten seconds or more, so it is not a few seconds' run).
set -uo pipefail
PART=${1:-all}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of this script on a machine without a GPU
QUICK=${QUICK:-}
# q FULL QUICK: the arguments of a step, as measured or under QUICK=1 (left unquoted: they are words)
q() { if [ -n "$QUICK" ]; then echo "$2"; else echo "$1"; fi; }
QCAL="--batch-sizes 1,2 --prompt-lens 6 --max-expert-tokens 32 --repeats 1"
QRUN="--batch-size 2 --num-batches 2 --prompt-len 6 --gen-len 2"
SMALL=$(q small-mixtral tiny-mixtral)
MIXTRAL=$(q mixtral-8x7b:4 tiny-mixtral)
case "$PART" in
  all|ladder|ladder-small|cpu-experts|serving|lease) ;;
  *) echo "gpu_validate.sh: unknown part '$PART' (all, ladder, ladder-small, cpu-experts, serving, lease)" >&2; exit 2 ;;
esac
if [ "$PART" = lease ]; then  # each part in its own process: one's failure leaves the others' results
  rc=0
  for part in cpu-experts ladder-small serving; do bash "$0" "$part" || rc=$?; done
  exit $rc
fi
SUF=$(case "$PART" in cpu-experts|serving) echo "-$PART" ;; esac)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import pydantic" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  else
    echo "pydantic missing and no wheels in .whl/: see experiments/README.md" >&2; exit 2
  fi
fi
if [ "$DEVICE" = cuda ]; then
  python3 - <<'PY' || { echo "no CUDA GPU visible to torch: nothing to do" >&2; exit 2; }
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PY
  GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
else
  GPU=dry-run-cpu
fi
if [ -n "$QUICK" ] && [ -z "${OUT_DIR:-}" ]; then  # (a dry run's files are no results to commit)
  OUT_DIR=$(mktemp -d -t klotski-gpu-validate-XXXXXX)
fi
OUT_DIR="${OUT_DIR:-experiments/results/$GPU}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/log$SUF.txt"
README="$OUT_DIR/README$SUF.md"
: > "$LOG"
start=$(date +%s)
{
  echo "# GPU validation on $GPU"
  echo
  echo "Produced by \`bash experiments/gpu_validate.sh\` on $(date -u +%Y-%m-%dT%H:%MZ)."
  [ -z "$QUICK" ] || echo "QUICK=1: tiny-mixtral at the smallest sizes, one repeat (a check of the script, no measurement)."
  echo
  python3 -c "import torch, transformers; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv 2>/dev/null || true
  echo "host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo
} > "$README"

copy_out() {  # the device machine brings back 8 files at most: one archive of OUT_DIR per part
  [ -n "${OUT:-}" ] || return 0
  cp "$README" "$OUT/" 2>/dev/null  # (the log is in the archive)
  tar czf "$OUT/results$SUF.tgz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" 2>/dev/null
  return 0
}
trap copy_out EXIT

# step LIMIT_S ARGS...: one klotski-runtime command, time-limited, logged; a failure is recorded
# in the README and the script goes on. The limits are sized for a GPU; a quick dry run on a shared
# CPU gets five times as long.
step() {
  local limit=$(( $1 * $(q 1 5) )); shift
  local t=$(date +%s)
  echo "+ klotski-runtime $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" python3 -m klotski_runtime.cli --debug "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "  (rc $rc, $(( $(date +%s) - t )) s)" | tee -a "$LOG"
  [ "$rc" = 0 ] || echo "- FAILED (rc $rc; 124 = over its ${limit} s limit): \`klotski-runtime $*\`" >> "$README"
}

RUN=$(q "--batch-size 16 --num-batches 4 --prompt-len 128 --gen-len 8" "$QRUN")
SM="--model $SMALL --profile $OUT_DIR/profile-small-mixtral.yaml $RUN"
MX="--model $MIXTRAL --profile $OUT_DIR/profile-mixtral-8x7b.yaml $RUN"

# calibrate LIMIT_S MODEL OUT ARGS...: a `step` calibrating MODEL into OUT; under QUICK=1 a model
# already calibrated in this run (both parts' models are tiny-mixtral) is copied, not measured again
calibrate() {
  local limit=$1 model=$2 out=$3; shift 3
  local done
  if [ -n "$QUICK" ]; then  # (a calibrated profile names its model in provenance.model_shapes)
    done=$(grep -l "^  model_shapes: $model\$" "$OUT_DIR"/profile-*.yaml 2>/dev/null \
           | grep -v -e -capped -e "$out" | head -1)
    if [ -n "$done" ]; then
      echo "+ cp $done $out (QUICK=1: $model is calibrated already)" | tee -a "$LOG"
      cp "$done" "$out"
      return
    fi
  fi
  step "$limit" calibrate --device "$DEVICE" --model "$model" "$@" --out "$out"
}

capped() {  # capped SRC DST BYTES: a copy of a calibrated profile with less GPU memory
  python3 - "$@" <<'PY'
import sys, yaml
src, dst, cap = sys.argv[1], sys.argv[2], float(sys.argv[3])
data = yaml.safe_load(open(src))
data["gpu"]["memory_bytes"], data["gpu"]["reserved_bytes"] = cap, 0.0  # the cap is what the schedules may use
data["name"] = data["name"] + f"-capped-{cap / 1e9:g}GB"
data.setdefault("sources", {})["gpu.memory_bytes"] = f"capped at {cap:g} bytes by gpu_validate.sh so that experts spill"
yaml.safe_dump(data, open(dst, "w"), sort_keys=False)
PY
}

if [ "$PART" = cpu-experts ]; then
  CPUX="fiddler,llamacpp-moe,klotski-hybrid,klotski"
  # tiny-mixtral's 0.4 MB cap: every policy still fits, and fiddler and llamacpp-moe keep experts on the CPU
  calibrate 60 "$SMALL" "$OUT_DIR/profile-small-mixtral.yaml" \
      $(q "--batch-sizes 1,16 --prompt-lens 128 --max-expert-tokens 2048" "$QCAL")
  capped "$OUT_DIR/profile-small-mixtral.yaml" "$OUT_DIR/profile-small-mixtral-capped.yaml" $(q 0.65e9 0.4e6)
  step 60 validate --policy $CPUX --impl both --repeats $(q 2 1) --device $DEVICE --model $SMALL \
      --profile "$OUT_DIR/profile-small-mixtral-capped.yaml" $RUN --out "$OUT_DIR/small-mixtral-cpu-experts"
  calibrate 90 "$MIXTRAL" "$OUT_DIR/profile-mixtral-8x7b.yaml" \
      $(q "--batch-sizes 1,16 --prompt-lens 128 --max-expert-tokens 2048" "$QCAL")
  capped "$OUT_DIR/profile-mixtral-8x7b.yaml" "$OUT_DIR/profile-mixtral-8x7b-capped.yaml" $(q 10e9 0.4e6)
  step 150 validate --policy $CPUX --impl both --repeats 1 --device $DEVICE --model $MIXTRAL \
      --profile "$OUT_DIR/profile-mixtral-8x7b-capped.yaml" $RUN --out "$OUT_DIR/mixtral-8x7b-4layers-cpu-experts"
fi

if [ "$PART" = serving ]; then
  # small-mixtral whole: the GPU is not short of memory, so validate_serving's defaults make
  # FluxMoE page all four MoE layers (0.7 GB a decode step) and vLLM-O offload two layers. (The
  # coder encodes on the host at ~70 MB/s: Mixtral-8x7B's layers would spend the lease on it.)
  step 240 validate --serve --device $DEVICE --model $SMALL \
      --policy vllm,vllm-o,ktransformers,fluxmoe-h,fluxmoe --requests $(q 8 2) \
      --prompt-len $(q 128 6) --output-len $(q 16 2) --repeats $(q 3 1) --out "$OUT_DIR/serving"
fi

if [ "$PART" = all ] || [ "$PART" = ladder ] || [ "$PART" = ladder-small ]; then
# 1. small-mixtral (whole model): calibrate, then all policies, both presets; then the KV cache in
#    host memory (pinned async stores and loads) for the two multi-batch systems that offload it
calibrate 90 "$SMALL" "$OUT_DIR/profile-small-mixtral.yaml" \
    $(q "--batch-sizes 1,4,8,16 --prompt-lens 64,128 --max-expert-tokens 2048" "$QCAL")
step 100 validate --policy all --impl both --repeats $(q 3 1) --device $DEVICE $SM --out "$OUT_DIR/small-mixtral"
step 40 validate --policy klotski,flexgen --impl both --repeats $(q 3 1) --device $DEVICE --kv cpu $SM \
    --out "$OUT_DIR/small-mixtral-kv-cpu"

fi
if [ "$PART" = all ] || [ "$PART" = ladder ]; then
# 2. Mixtral-8x7B shapes, first 4 of 32 layers (random weights of the true shapes)
calibrate 90 "$MIXTRAL" "$OUT_DIR/profile-mixtral-8x7b.yaml" \
    $(q "--batch-sizes 1,4,16 --prompt-lens 64,128 --max-expert-tokens 2048" "$QCAL")
step 300 validate --policy all --impl both --repeats $(q 3 1) --device $DEVICE $MX --out "$OUT_DIR/mixtral-8x7b-4layers"
fi

{
  echo
  echo "## Results"
  echo
  echo '```'
  grep -E -A16 "^(policy|\+ klotski-runtime validate)" "$LOG" || true
  echo '```'
  echo
  echo "Wall time: $(( $(date +%s) - start )) s."
} >> "$README"
echo "wrote $OUT_DIR/"
