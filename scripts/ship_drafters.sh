#!/usr/bin/env bash
# Copy trained testbed drafters (official format, 16-bit, no embedding) into the package:
#   RUNS=/path/to/runs bash scripts/ship_drafters.sh    # expects RUNS/{gumiho,eagle2,medusa}
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:?set RUNS to the dir holding gumiho/ eagle2/ medusa/ training outputs}
for m in gumiho eagle2 medusa; do
  mkdir -p "gumiho/assets/smollm2/$m"
  cp "$RUNS/$m/model.safetensors" "$RUNS/$m/config.json" "gumiho/assets/smollm2/$m/"
  [[ -f "$RUNS/$m/train_summary.json" ]] && cp "$RUNS/$m/train_summary.json" "gumiho/assets/smollm2/$m/"
done
du -sh gumiho/assets/smollm2/*
