#!/usr/bin/env bash
# The paper's runs on Llama-3-8B-Instruct (and 70B): the paper's main table, on a GPU, with local weights:
#   TARGET=/models/target GUMIHO_DRAFT=/models/Gumiho-llama3 EAGLE_DRAFT=/models/EAGLE-llama3 \
#   [MEDUSA_DRAFT=/models/medusa-llama3] bash scripts/eval_llama3.sh
# Official tree settings (Gumiho 64 tokens, top-k 14, MLP 35/35; EAGLE-2 60/6/10; Medusa
# 63-node static tree), 80 questions x six benchmarks, T=0 and T=1.
# Paths (TARGET, the *_DRAFT variables, OUT) are the caller's: the script stays in the
# caller's folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # gumiho from this tree, installed or not
source "$root/scripts/eval_common.sh"
run_real_model llama3
