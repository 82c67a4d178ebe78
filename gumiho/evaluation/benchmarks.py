"""The six benchmarks (80 questions each) and how their prompts are built.

Files live in `gumiho/evaluation/data/` (see SOURCES.md there). MT-Bench is two-turn: the
second turn is asked after the model's own first answer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gumiho.errors import GumihoError

DATA = Path(__file__).parent / "data"
BENCHMARKS = {  # name -> label used in tables (substitutes say so)
    "mt_bench": "MT-Bench", "humaneval": "HumanEval", "gsm8k_like": "GSM8K-like",
    "alpaca_like": "Alpaca-like", "cnndm_like": "CNN/DM-like", "nq_like": "NQ-like",
}
# Not one of the six: first user turns of the ShareGPT held-out split (never trained on).
HELD_OUT = "sharegpt_heldout"
LABELS = {**BENCHMARKS, HELD_OUT: "ShareGPT held-out"}
MAX_HELD_OUT_CHARS = 1500  # skip very long prompts


def load_questions(bench: str) -> list[dict]:
    """[{"question_id", "category", "turns": [str, ...]}, ...] of one benchmark."""
    if bench == HELD_OUT:
        return held_out_questions()
    if bench not in BENCHMARKS:
        raise GumihoError(f"unknown benchmark {bench!r}: use one of {', '.join(LABELS)}")
    path = DATA / f"{bench}.jsonl"
    # "\n" only: str.splitlines also splits at U+2028 and the like, which a question may hold
    lines = path.read_text(encoding="utf-8").split("\n")
    return [json.loads(line) for line in lines if line.strip()]


def held_out_questions(count: int = 80) -> list[dict]:
    from gumiho.ge_data.conversations import load_conversations, split

    _, held = split(load_conversations("sharegpt"))
    firsts = [(c["id"], next(m["content"] for m in c["messages"] if m["role"] == "user"))
              for c in held]
    return [{"question_id": cid, "category": "sharegpt", "turns": [text]}
            for cid, text in firsts if 0 < len(text) <= MAX_HELD_OUT_CHARS][:count]


def pick_questions(bench: str, begin: int, end: int | None, doing: str = "answering"
                   ) -> list[dict]:
    """Questions begin..end-1 of `bench` (--question-begin, --question-end), checked."""
    questions = load_questions(bench)
    if end is not None and end <= begin:
        raise GumihoError(f"--question-end {end} must be greater than --question-begin {begin}")
    if begin >= len(questions):
        raise GumihoError(f"--question-begin {begin} is beyond {bench}'s {len(questions)} "
                          f"questions (0..{len(questions) - 1})")
    if end is not None and end > len(questions):  # a slice would quietly stop at the end
        print(f"note: --question-end {end} is past {bench}'s {len(questions)} questions: "
              f"{doing} {begin}..{len(questions) - 1}", file=sys.stderr)
    return questions[begin:end]
