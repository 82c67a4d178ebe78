#!/usr/bin/env bash
# The paper's comparison on the offline testbed: SmolLM2-135M-Instruct with the shipped
# Gumiho, EAGLE-2 and Medusa drafters vs plain decoding, six benchmarks, T=0 and T=1.
#   bash scripts/eval_smollm2.sh            # full: 80 questions, 512 new tokens
#   QUICK=1 bash scripts/eval_smollm2.sh    # minutes on a CPU: 2 questions, 64 tokens, T=0
# Tree settings: the methods' reference settings unless *_ARGS say otherwise, e.g.
#   GUMIHO_ARGS="--total-tokens 24" (README's CPU table names the settings it used), or
#   GUMIHO_ARGS="--preset demo" EAGLE_ARGS="--preset demo" MEDUSA_ARGS="--preset demo"
#   for what `gumiho demo` runs (an auto-sized tree, lookup first, float32 floors).
# Paths (OUT, the *_DRAFT variables, paths in *_ARGS) are the caller's: the script stays in
# the caller's folder (it once moved to the repository root, so GUMIHO_DRAFT=tr1 was looked
# for there); the shipped drafters are found from anywhere.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # gumiho from this tree, installed or not
source "$root/scripts/eval_common.sh"
ASSETS=$root/gumiho/assets/smollm2
TARGET=smollm2
GUMIHO_DRAFT=${GUMIHO_DRAFT-$ASSETS/gumiho}
EAGLE_DRAFT=${EAGLE_DRAFT-$ASSETS/eagle2}
MEDUSA_DRAFT=${MEDUSA_DRAFT-$ASSETS/medusa}
if [[ "${QUICK:-0}" == "1" ]]; then
  OUT=${OUT:-runs/eval_smollm2_quick}; TEMPS=${TEMPS:-0}; QEND=${QEND:-2}; MAXNEW=${MAXNEW:-64}
else
  OUT=${OUT:-runs/eval_smollm2}; TEMPS=${TEMPS:-"0 1"}; QEND=${QEND:-80}; MAXNEW=${MAXNEW:-512}
fi
run_all
echo "report: $OUT/report.md"
