# Shared by the eval_*.sh scripts: run every method on every benchmark, then the report.
# Expects: TARGET, OUT, TEMPS, QEND, MAXNEW, and per method a draft path (empty = skip):
# GUMIHO_DRAFT, EAGLE_DRAFT, MEDUSA_DRAFT; extra flags: GUMIHO_ARGS, EAGLE_ARGS,
# MEDUSA_ARGS, LOOKUP_ARGS, COMMON_ARGS. Prompt lookup (no drafter) runs too unless
# LOOKUP=0: it is the zero-cost peer every drafter has to beat. GUMIHO_VARIANTS: more
# Gumiho runs beside it, '|'-separated flag sets added to GUMIHO_ARGS (e.g.
# "--min-confidence 0.1|--min-confidence 0.2"), each in its own answer files, run right
# after it on every benchmark so their speeds compare side by side.
# INTERLEAVE=1 (default): one process per benchmark answers each question with every method
# in turn, the order rotating (gumiho.evaluation.interleave), so the machine's drift falls on
# all methods alike; INTERLEAVE=0: one gen_answers per method, all questions in a row.
BENCHES=${BENCHES:-"mt_bench humaneval gsm8k_like alpaca_like cnndm_like nq_like"}

# The two ways to run one method on the current $temp and $bench: method draft extra-flags...
answer() {  # one gen_answers process, all questions in a row
  local method=$1 draft=$2; shift 2
  local draft_args=()
  [[ -n "$draft" ]] && draft_args=(--draft "$draft")
  python3 -m gumiho.evaluation.gen_answers --target "$TARGET" --method "$method" \
    "${draft_args[@]}" --bench "$bench" --temperature "$temp" --question-end "$QEND" \
    --max-new-tokens "$MAXNEW" --answer-file "$(answer_file "$method")" ${COMMON_ARGS:-} "$@"
}

add_run() {  # one --run of the interleaved process (RUNS)
  local method=$1 draft=$2; shift 2
  local flags
  flags="--method $method --answer-file $(printf %q "$(answer_file "$method")")"
  [[ -n "$draft" ]] && flags+=" --draft $(printf %q "$draft")"
  RUNS+=(--run "$flags $*")
}

answer_file() { echo "$OUT/T$temp/${bench}_$1${SUFFIX:-}.jsonl"; }

each_method() {  # answer | add_run, for every method this run compares
  local call=$1
  $call ar ""
  [[ "${LOOKUP:-1}" == "1" ]] && $call lookup "" ${LOOKUP_ARGS:-}
  [[ -n "${GUMIHO_DRAFT:-}" ]] && $call gumiho "$GUMIHO_DRAFT" ${GUMIHO_ARGS:-}
  if [[ -n "${GUMIHO_DRAFT:-}" && -n "${GUMIHO_VARIANTS:-}" ]]; then
    IFS='|' read -ra variants <<< "$GUMIHO_VARIANTS"
    for i in "${!variants[@]}"; do
      # shellcheck disable=SC2086  # each variant is a set of flags
      SUFFIX="_v$((i + 1))" $call gumiho "$GUMIHO_DRAFT" ${GUMIHO_ARGS:-} ${variants[$i]}
    done
  fi
  [[ -n "${EAGLE_DRAFT:-}" ]] && $call eagle2 "$EAGLE_DRAFT" ${EAGLE_ARGS:-}
  [[ -n "${MEDUSA_DRAFT:-}" ]] && $call medusa "$MEDUSA_DRAFT" ${MEDUSA_ARGS:-}
  return 0
}

run_all() {
  for temp in $TEMPS; do
    for bench in $BENCHES; do
      if [[ "${INTERLEAVE:-1}" == "1" ]]; then
        RUNS=()
        each_method add_run
        # shellcheck disable=SC2086  # COMMON_ARGS is a set of flags
        python3 -m gumiho.evaluation.interleave --target "$TARGET" --bench "$bench" \
          --temperature "$temp" --question-end "$QEND" --max-new-tokens "$MAXNEW" \
          ${COMMON_ARGS:-} "${RUNS[@]}"
      else
        each_method answer
      fi
    done
  done
  # the questions this run asked for (OUT may hold an earlier run's answers to more)
  python3 -m gumiho.evaluation.speed --answers "$OUT"/T*/*.jsonl --out "$OUT/report" \
    --question-end "$QEND"
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

run_real_model() {  # name [flags added to COMMON_ARGS]: the paper's run of one model family on a GPU
  local name=$1 extra=${2:-}
  need_dir TARGET "Hugging Face target model"
  need_dir GUMIHO_DRAFT "Gumiho drafter checkpoint"
  [[ -n "${EAGLE_DRAFT:-}" ]] && need_dir EAGLE_DRAFT "EAGLE-2 drafter checkpoint"
  [[ -n "${MEDUSA_DRAFT:-}" ]] && need_dir MEDUSA_DRAFT "Medusa checkpoint"
  need_gpu "scripts/eval_$name.sh"
  OUT=${OUT:-runs/eval_$name}; TEMPS=${TEMPS:-"0 1"}; QEND=${QEND:-80}; MAXNEW=${MAXNEW:-1024}
  # the family's own flags (vicuna's chat template) stay when the caller sets COMMON_ARGS
  COMMON_ARGS="${COMMON_ARGS:-"--device cuda"}${extra:+ $extra}"
  run_all
  echo "report: $OUT/report.md"
}
