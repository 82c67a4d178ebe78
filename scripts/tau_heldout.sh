#!/usr/bin/env bash
# tau of drafters on held-out ShareGPT prompts (greedy), every run in one sequence, then
# one speed report per drafter beside plain decoding and prompt lookup.
#   bash scripts/tau_heldout.sh OUT NAME:METHOD:DRAFT_DIR ...
#   e.g. bash scripts/tau_heldout.sh runs/tau gumiho_1k:gumiho:gumiho/assets/smollm2/gumiho \
#          eagle2_1k:eagle2:gumiho/assets/smollm2/eagle2
# QEND (10) prompts, MAXNEW (96) new tokens; extra gen_answers flags in ARGS (e.g. --total-tokens auto).
# Answer files already complete in OUT (QEND lines) are kept, whatever settings made them
# (a new OUT for new settings); a cut-off run starts over the file it stopped in.
# Paths are the caller's: the script stays in the caller's folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # gumiho from this tree, installed or not
[[ $# -ge 2 ]] || { echo "usage: bash scripts/tau_heldout.sh OUT NAME:METHOD:DRAFT_DIR ..." >&2; exit 2; }
OUT=$1; shift
QEND=${QEND:-10}; MAXNEW=${MAXNEW:-96}
for spec in "$@"; do
  IFS=: read -r name method draft <<< "$spec"
  [[ -n $name && -n $method && -n $draft ]] || { echo "error: '$spec' is not NAME:METHOD:DRAFT_DIR" >&2; exit 2; }
  [[ -d $draft ]] || { echo "error: drafter directory '$draft' does not exist" >&2; exit 2; }
done
mkdir -p "$OUT"
gen() {  # name, then gen_answers flags
  local name=$1; shift
  local file="$OUT/$name.jsonl"
  if [[ -s $file && $(wc -l < "$file") -ge $QEND ]]; then return 0; fi
  python3 -m gumiho.evaluation.gen_answers --bench sharegpt_heldout --question-end "$QEND" \
    --max-new-tokens "$MAXNEW" --answer-file "$file" --overwrite "$@"
}
gen ar --method ar
gen lookup --method lookup
for spec in "$@"; do
  IFS=: read -r name method draft <<< "$spec"
  # shellcheck disable=SC2086
  gen "$name" --method "$method" --draft "$draft" ${ARGS:-}
done
for spec in "$@"; do
  name=${spec%%:*}
  python3 -m gumiho.evaluation.speed --answers "$OUT/ar.jsonl" "$OUT/lookup.jsonl" "$OUT/$name.jsonl" \
    --out "$OUT/report_$name"
done
echo "reports: $OUT/report_*.md"
