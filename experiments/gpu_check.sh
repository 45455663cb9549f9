#!/usr/bin/env bash
# One check of a machine with an accelerator (see experiments/gpu_check.py): a random
# LLaDA-8B in bfloat16, one full forward at T = 1024, one cached call of 32 queries, one
# 512-token generation per sampler, then the int8 variant (the linear layers quantized
# to int8, one more AsyncLane generation) and before it the scanned variant (the same
# model with scanned layers, one more AsyncLane generation); the last line printed is
# one JSON object. Within 8 minutes on one H200: the script stops starting samplers
# after --budget-s (420 s; the last 2 x 60 s of it kept for the scanned and int8
# generations), and `timeout` ends it at 470 s whatever happens.
#
#   experiments/gpu_check.sh                      # LLaDA-8B on the accelerator
#   experiments/gpu_check.sh --preset tiny-llada-test --length 64 --gen-length 64   # CPU
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
exec timeout --signal=TERM --kill-after=10 470 "$PYTHON" experiments/gpu_check.py "$@"
