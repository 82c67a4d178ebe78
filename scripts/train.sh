#!/usr/bin/env bash
# Train a drafter with accelerate (one CPU, one GPU, many GPUs, DeepSpeed: one script).
#   bash scripts/train.sh --data DIR --method gumiho --output-dir OUT [more gumiho.train flags]
#   ACCELERATE_CONFIG=configs/deepspeed_zero2.yaml bash scripts/train.sh ...   # ZeRO-2
# Defaults: the embedded SmolLM2 target; configs/accelerate_single.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${ACCELERATE_CONFIG:-configs/accelerate_single.yaml}"
exec accelerate launch --config_file "$config" -m gumiho.train "$@"
