#!/usr/bin/env bash
# Characterise this machine for training (issue 5): device peak, ResNet-18 batch sweeps on the host and
# rpi4 profiles, the fraction of the one-core GEMM peak that ResNet-18 training reaches, data stalls on
# the CIFAR-10 subset, and one HTML report of it all. Every figure is measured in this run; the
# fractions of peak are ratios of two numbers measured side by side.
#
#   benchmarks/characterise.sh [OUT_DIR] [CIFAR_DIR]
#
# Takes about 20-30 minutes on 2 cores (the throttled rpi4 sweep is most of it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/characterise}
CIFAR=${2:-../shared/data/cifar10-subset/cifar-10-batches-py}
EDGETRAIN=${EDGETRAIN:-edgetrain}
PYTHON=${PYTHON:-python3}  # the interpreter that has edgetrain installed (make setup: .venv/bin/python)
mkdir -p "$OUT"

# 1. Peak: GEMM (float32) and LINPACK (float64, residual-checked) at 1 and 2 threads.
$EDGETRAIN bench peak --threads 1,2 --gemm-sizes 512,1024,2048 --linpack-sizes 1000,2000,4000 \
    --output "$OUT" --name peak

# 2. Throughput and memory versus batch size, ResNet-18 on CIFAR-shaped data.
$EDGETRAIN bench batch --model resnet18 --profile host --max-batch 512 --steps 2 --output "$OUT" --name batch-host
#    rpi4: 4 GB memory limit, compute throttled to the profile's 15.5 GFLOPS (edgetrain.cluster.throttle).
#    One thread runs at 0.15 of a host core, so this sweep is the slow part; it stops at the 4 GB limit.
$EDGETRAIN bench batch --model resnet18 --profile rpi4 --start-batch 8 --max-batch 1024 --steps 1 \
    --output "$OUT" --name batch-rpi4

# 3. Achieved fraction of the one-core GEMM peak: real training steps with one thread.
$EDGETRAIN bench batch --model resnet18 --profile host --threads 1 --start-batch 16 --max-batch 128 --steps 2 \
    --output "$OUT" --name batch-host-1thread

#    The same fraction with training steps and GEMMs interleaved in one process (robust to a shared machine).
$PYTHON benchmarks/fraction_of_peak.py --batches 32,64 --rounds 6

# 4. Data stalls on the CIFAR-10 subset: ResNet-18 (compute-heavy) and the small CNN (data-hungry);
#    training on one thread leaves the other core to the loader workers.
$EDGETRAIN bench stalls --data-dir "$CIFAR" --model resnet18 --batch-size 64 --epoch-samples 256 --max-workers 2 --threads 1 \
    --output "$OUT" --name stalls-resnet18
$EDGETRAIN bench stalls --data-dir "$CIFAR" --model small_cnn --batch-size 64 --epoch-samples 2048 --max-workers 2 --threads 1 \
    --output "$OUT" --name stalls-small-cnn

# 5. Scaling over 1, 2 and 4 emulated devices (one thread each, so a device's work is the same at every count).
$EDGETRAIN bench scaling --devices 1,2,4 --model small_cnn --dataset digits --batch-size 32 --steps 20 --threads 1 \
    --output "$OUT" --name scaling

# 6. One page with everything.
$EDGETRAIN report "$OUT"/peak "$OUT"/batch-host "$OUT"/batch-rpi4 "$OUT"/batch-host-1thread \
    "$OUT"/stalls-resnet18 "$OUT"/stalls-small-cnn "$OUT"/scaling -o "$OUT"/report.html
