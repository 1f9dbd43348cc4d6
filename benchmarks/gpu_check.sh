#!/usr/bin/env bash
# The CUDA path on a machine with an NVIDIA GPU: the suite's CUDA tests (every strategy and exchange for a few
# steps on the GPU), then a short training on the GPU beside the same run on the CPU; GPU_CHECK_PROBE=1 first
# asks which gloo collectives take CUDA tensors. Run from the repo root: bash benchmarks/gpu_check.sh [OUTDIR]
# Uses the python3 on PATH and this checkout's src/ (no install: the machine's own CUDA torch stays).
set -u
out=${1:-runs/gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
py=python3
echo "== machine"; date -u; nvidia-smi -L; $py -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
if [ -n "${GPU_CHECK_PROBE:-}" ]; then
  echo "== gloo collectives with CUDA tensors (two processes, one GPU)"
  timeout 300 $py benchmarks/gloo_cuda_probe.py
fi
echo "== CUDA tests: every strategy and exchange for a few steps on the GPU (tests/train/test_strategy.py)"
$py -m pytest -q -rA -p no:cacheprovider --timeout 150 --basetemp "$out/pytest" tests/train/test_strategy.py \
    -k "gpu or cuda" 2>&1 | grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed'
for log in $(grep -l Traceback $(find "$out/pytest" -name 'device-*.log') 2>/dev/null | head -4); do
  echo "-- $log"; grep -E 'Error|error' "$log" | tail -2; grep -E '^  File "/' "$log" | tail -2
done
[ -n "${GPU_CHECK_QUICK:-}" ] && exit 0
for acc in cuda cpu; do
  echo "== resnet18, synthetic 32x32, 2 devices, 20 steps of 64, accelerator $acc"
  $py -m edgetrain train --devices 2 --model resnet18 --dataset synthetic --steps 20 --batch-size 64 --no-eval \
      --accelerator $acc --no-progress --output "$out/r18-$acc" 2>&1 | tail -6
done
