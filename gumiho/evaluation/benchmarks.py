"""The six benchmarks (80 questions each) and how their prompts are built.

Files live in `gumiho/evaluation/data/` (see SOURCES.md there). MT-Bench is two-turn: the
second turn is asked after the model's own first answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from gumiho.errors import GumihoError

DATA = Path(__file__).parent / "data"
BENCHMARKS = {  # name -> label used in tables (substitutes say so)
    "mt_bench": "MT-Bench", "humaneval": "HumanEval", "gsm8k_like": "GSM8K-like",
    "alpaca_like": "Alpaca-like", "cnndm_like": "CNN/DM-like", "nq_like": "NQ-like",
}


def load_questions(bench: str) -> list[dict]:
    """[{"question_id", "category", "turns": [str, ...]}, ...] of one benchmark."""
    if bench not in BENCHMARKS:
        raise GumihoError(f"unknown benchmark {bench!r}: use one of {', '.join(BENCHMARKS)}")
    path = DATA / f"{bench}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
