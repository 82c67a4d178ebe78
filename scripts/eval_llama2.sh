#!/usr/bin/env bash
# The paper's runs on Llama-2-chat (7B/13B/70B), on a GPU, with local weights:
#   TARGET=/models/target GUMIHO_DRAFT=/models/Gumiho-llama2 EAGLE_DRAFT=/models/EAGLE-llama2 \
#   [MEDUSA_DRAFT=/models/medusa-llama2] bash scripts/eval_llama2.sh
# Official tree settings (Gumiho 64 tokens, top-k 14, MLP 35/35; EAGLE-2 60/6/10; Medusa
# 63-node static tree), 80 questions x six benchmarks, T=0 and T=1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/eval_common.sh
need_dir TARGET "Hugging Face target model"
need_dir GUMIHO_DRAFT "Gumiho drafter checkpoint"
[[ -n "${EAGLE_DRAFT:-}" ]] && need_dir EAGLE_DRAFT "EAGLE-2 drafter checkpoint"
[[ -n "${MEDUSA_DRAFT:-}" ]] && need_dir MEDUSA_DRAFT "Medusa checkpoint"
need_gpu "scripts/eval_llama2.sh"
OUT=${OUT:-runs/eval_llama2}; TEMPS=${TEMPS:-"0 1"}; QEND=${QEND:-80}; MAXNEW=${MAXNEW:-1024}
COMMON_ARGS=${COMMON_ARGS:-"--device cuda"}
run_all
echo "report: $OUT/report.md"
