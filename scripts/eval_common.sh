# Shared by the eval_*.sh scripts: run every method on every benchmark, then the report.
# Expects: TARGET, OUT, TEMPS, QEND, MAXNEW, and per method a draft path (empty = skip):
# GUMIHO_DRAFT, EAGLE_DRAFT, MEDUSA_DRAFT; extra flags: GUMIHO_ARGS, EAGLE_ARGS,
# MEDUSA_ARGS, LOOKUP_ARGS, COMMON_ARGS. Prompt lookup (no drafter) runs too unless
# LOOKUP=0: it is the zero-cost peer every drafter has to beat. GUMIHO_VARIANTS: more
# Gumiho runs beside it, '|'-separated flag sets added to GUMIHO_ARGS (e.g.
# "--min-confidence 0.1|--min-confidence 0.2"), each in its own answer files, run right
# after it on every benchmark so their speeds compare side by side.
BENCHES=${BENCHES:-"mt_bench humaneval gsm8k_like alpaca_like cnndm_like nq_like"}

answer() {  # method draft temperature bench extra-args...
  local method=$1 draft=$2 temp=$3 bench=$4; shift 4
  local draft_args=()
  [[ -n "$draft" ]] && draft_args=(--draft "$draft")
  python3 -m gumiho.evaluation.gen_answers --target "$TARGET" --method "$method" \
    "${draft_args[@]}" --bench "$bench" --temperature "$temp" --question-end "$QEND" \
    --max-new-tokens "$MAXNEW" --answer-file "$OUT/T$temp/${bench}_${method}${SUFFIX:-}.jsonl" \
    ${COMMON_ARGS:-} "$@"
}

run_all() {
  for temp in $TEMPS; do
    for bench in $BENCHES; do
      answer ar "" "$temp" "$bench"
      [[ "${LOOKUP:-1}" == "1" ]] && answer lookup "" "$temp" "$bench" ${LOOKUP_ARGS:-}
      [[ -n "${GUMIHO_DRAFT:-}" ]] && answer gumiho "$GUMIHO_DRAFT" "$temp" "$bench" ${GUMIHO_ARGS:-}
      if [[ -n "${GUMIHO_DRAFT:-}" && -n "${GUMIHO_VARIANTS:-}" ]]; then
        IFS='|' read -ra variants <<< "$GUMIHO_VARIANTS"
        for i in "${!variants[@]}"; do
          # shellcheck disable=SC2086  # each variant is a set of flags
          SUFFIX="_v$((i + 1))" answer gumiho "$GUMIHO_DRAFT" "$temp" "$bench" \
            ${GUMIHO_ARGS:-} ${variants[$i]}
        done
      fi
      [[ -n "${EAGLE_DRAFT:-}" ]] && answer eagle2 "$EAGLE_DRAFT" "$temp" "$bench" ${EAGLE_ARGS:-}
      [[ -n "${MEDUSA_DRAFT:-}" ]] && answer medusa "$MEDUSA_DRAFT" "$temp" "$bench" ${MEDUSA_ARGS:-}
    done
  done
  python3 -m gumiho.evaluation.speed --answers "$OUT"/T*/*.jsonl --out "$OUT/report"
}

need_dir() {  # variable-name description
  local value=${!1:-}
  if [[ -z "$value" || ! -d "$value" ]]; then
    echo "error: set $1 to a local $2 directory (got '${value}')" >&2
    exit 2
  fi
}

need_gpu() {
  if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: $1 needs a GPU (CUDA or ROCm); none is visible here" >&2
    exit 2
  fi
}

run_real_model() {  # name [extra COMMON_ARGS]: the paper's run of one model family on a GPU
  local name=$1 extra=${2:-}
  need_dir TARGET "Hugging Face target model"
  need_dir GUMIHO_DRAFT "Gumiho drafter checkpoint"
  [[ -n "${EAGLE_DRAFT:-}" ]] && need_dir EAGLE_DRAFT "EAGLE-2 drafter checkpoint"
  [[ -n "${MEDUSA_DRAFT:-}" ]] && need_dir MEDUSA_DRAFT "Medusa checkpoint"
  need_gpu "scripts/eval_$name.sh"
  OUT=${OUT:-runs/eval_$name}; TEMPS=${TEMPS:-"0 1"}; QEND=${QEND:-80}; MAXNEW=${MAXNEW:-1024}
  COMMON_ARGS=${COMMON_ARGS:-"--device cuda $extra"}
  run_all
  echo "report: $OUT/report.md"
}
