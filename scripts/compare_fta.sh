#!/usr/bin/env bash
# tau of one Gumiho drafter with --fta off, exact and official on held-out ShareGPT prompts
# (greedy). Plain decoding runs too, so the report also has speedups.
#   DRAFT=gumiho/assets/smollm2/gumiho QEND=10 bash scripts/compare_fta.sh
# Paths are the caller's: the script stays in the caller's folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # gumiho from this tree, installed or not
TARGET=${TARGET:-smollm2}
DRAFT=${DRAFT:-$root/gumiho/assets/smollm2/gumiho}
OUT=${OUT:-runs/compare_fta}
QEND=${QEND:-10}
MAXNEW=${MAXNEW:-128}
TREE_ARGS=${TREE_ARGS:-}
common=(--target "$TARGET" --bench sharegpt_heldout --question-end "$QEND"
        --max-new-tokens "$MAXNEW")
python3 -m gumiho.evaluation.gen_answers "${common[@]}" --method ar --answer-file "$OUT/ar.jsonl"
for fta in off exact official; do
  python3 -m gumiho.evaluation.gen_answers "${common[@]}" --method gumiho --draft "$DRAFT" \
    --fta "$fta" $TREE_ARGS --answer-file "$OUT/gumiho_$fta.jsonl"
done
python3 -m gumiho.evaluation.speed --answers "$OUT"/*.jsonl --out "$OUT/report"
