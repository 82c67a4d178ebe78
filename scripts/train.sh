#!/usr/bin/env bash
# Train a drafter with accelerate (one CPU, one GPU, many GPUs, DeepSpeed: one script).
#   bash scripts/train.sh --data DIR --method gumiho --output-dir OUT [more gumiho.train flags]
#   ACCELERATE_CONFIG=configs/deepspeed_zero2.yaml bash scripts/train.sh ...   # ZeRO-2
# Defaults: the embedded SmolLM2 target; configs/accelerate_single.yaml.
# Bad arguments stop here with the trainer's own one-line error and exit status (a dry run
# first); one process runs the trainer directly, more go through `accelerate launch` by way
# of gumiho.train.launch, which reports a process's failure as that one line too and
# starts one process per GPU where the config names no count (NUM_PROCESSES=N to choose).
# Paths in the flags are the caller's: the script stays in the caller's folder (it once
# moved to the repository root, so --data and --output-dir resolved there).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # gumiho from this tree, installed or not
config="${ACCELERATE_CONFIG:-$root/configs/accelerate_single.yaml}"
if [[ ! -f "$config" && "$config" != /* && -f "$root/$config" ]]; then
  config="$root/$config"  # configs/... named from elsewhere: this tree's
fi
if [[ ! -f "$config" ]]; then
  echo "error: accelerate config $config not found (set ACCELERATE_CONFIG)" >&2
  exit 2
fi
python3 -m gumiho.train --dry-run "$@" >/dev/null || exit $?
if grep -qE '^num_processes: *1\b' "$config" && grep -qE '^distributed_type: *"?NO' "$config"; then
  exec python3 -m gumiho.train "$@"
fi
exec python3 -m gumiho.train.launch --config-file "$config" "$@"
