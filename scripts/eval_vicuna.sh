#!/usr/bin/env bash
# The paper's runs on Vicuna-7B/13B (no chat template: fschat's vicuna_v1.1 layout), on a GPU, with local weights:
#   TARGET=/models/target GUMIHO_DRAFT=/models/Gumiho-vicuna EAGLE_DRAFT=/models/EAGLE-vicuna \
#   [MEDUSA_DRAFT=/models/medusa-vicuna] bash scripts/eval_vicuna.sh
# Official tree settings (Gumiho 64 tokens, top-k 14, MLP 35/35; EAGLE-2 60/6/10; Medusa
# 63-node static tree), 80 questions x six benchmarks, T=0 and T=1.
# Paths are the caller's: the script stays in the caller's folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # gumiho from this tree, installed or not
source "$root/scripts/eval_common.sh"
run_real_model vicuna "--chat-template vicuna"
